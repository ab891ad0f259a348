"""The run config: one typed dataclass, loaded from YAML, overridden from the
command line, validated before any process group starts, and saved with the run
as `run_config.yaml`.

FSDP knobs are *not* here: they live in `accelerate_configs/*.yaml` and reach
the program through `accelerate launch`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import shlex
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from finetune.data.fingerprint import INPUT_OPTIONS, absolute
from finetune.data.formats import DATA_FORMATS, FORMATS
from finetune.errors import UsageError, not_a_file
from finetune.models.attention import IMPLEMENTATIONS as ATTN_IMPLEMENTATIONS
from finetune.objectives import (DEFAULT as DEFAULT_OBJECTIVE, OBJECTIVES, READERS as OBJECTIVE_READERS,
                                 REGISTRY as OBJECTIVE_REGISTRY, SECTIONS as OBJECTIVE_SECTIONS, recorded_objective)
from finetune.objectives.rewards import absolute_reward, is_user_code
from finetune.options import option
from finetune.peft import (PEFT_METHODS, READERS as PEFT_READERS, REGISTRY as PEFT_REGISTRY,
                           SECTIONS as PEFT_SECTIONS)
from finetune.tasks import REGISTRY

TASKS = tuple(REGISTRY)

OPTIMIZERS = ("adamw", "adam")
# transformers.get_scheduler's names, and the lectures' per-epoch StepLR.
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup", "polynomial", "step")
REPORTERS = ("jsonl", "tensorboard", "wandb", "mlflow", "none")
LONG_EXAMPLES = ("truncate", "drop")
LOG_FORMATS = ("auto", "bar", "plain")
MODEL_DTYPES = ("float32", "bfloat16")
TEXT_SAMPLE_BY = ("line", "paragraph", "document")  # datasets' text builder's names
MIXTURE_STOPS = ("first_exhausted", "all_exhausted")  # datasets.interleave_datasets' names
MIN_SHARE_TO_EXHAUST = 1e-6  # under all_exhausted, a rarer source would take ~10^6 draws per example of its own
TEXT_SAMPLE_BY_OF_OLDER_RUNS = "line"  # what runs recorded before text_sample_by existed did

# What changing an option on a resume does (its `on_resume`); an option without
# one is fixed by the checkpoint: the data, its order, the model and the
# optimizer's construction depend on it.
NEXT_STEP = "applies from the next step"
NEW_END = ("the run now ends there; the learning-rate schedule is stretched or shrunk to the new length from the next "
           "step on")
# Permissions no file can grant: what each allows, and when to give it.
COMMAND_LINE_ONLY = {
    "trust_remote_code": ("lets the model's or data's own code run", " if you trust {model}"),
    "allow_unverified_checkpoint": ("reads a checkpoint that cannot be checked", ""),
}
RESUME_BOOKKEEPING = ("output_dir", "resume_from_checkpoint", "overwrite", "allow_unverified_checkpoint")

# The options that shape a run's data: recorded with its model (model_dir.py)
# so that `finetune evaluate` rebuilds the data the run evaluated on.
DATA_OPTIONS = ("dataset", "dataset_config", "dataset_split", "eval_split", "data_format", "text_column",
                "dataset_weights", "mixture_stop", "streaming", "text_sample_by", "chat_template", "train_on_prompt",
                "train_on_reasoning", "packing", "long_examples", "block_size", "max_prompt_length",
                "max_eval_samples", "image_column", "label_column", "validation_split", "seed", "max_pixels", "min_pixels",
                "image_size")


def data_options(config: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The record of a run's data: its DATA_OPTIONS, and how many held-out rows
    its evaluations scored (0 = all): each rank takes every world_size-th
    batch, up to max_eval_batches of them."""
    batch = config.get("per_device_eval_batch_size") or config.get("per_device_batch_size", 0)
    return {**{name: config[name] for name in DATA_OPTIONS if name in config},
            "objective": recorded_objective(config),  # what the held-out data was: text, pairs or prompts
            "text_sample_by": config.get("text_sample_by", TEXT_SAMPLE_BY_OF_OLDER_RUNS),
            "max_eval_rows": config.get("max_eval_batches", 0) * world_size * batch}


BYTE_UNITS = {"tib": 1024**4, "tb": 10**12, "gib": 1024**3, "gb": 10**9, "mib": 1024**2, "mb": 10**6,
              "kib": 1024, "kb": 10**3, "b": 1}


def byte_count(text: str) -> int:
    """80GB, 80GiB, 500MB or a plain number of bytes; ValueError for anything else or <= 0."""
    lowered = str(text).strip().lower()
    suffix = next((u for u in BYTE_UNITS if lowered.endswith(u)), "")
    number = float(lowered[: len(lowered) - len(suffix)]) * BYTE_UNITS.get(suffix, 1)
    if not math.isfinite(number):  # inf, nan: no size
        raise ValueError(f"must be a finite size, got {text!r}")
    value = int(number)
    if value <= 0:
        raise ValueError(f"must be > 0, got {text!r}")
    return value


@dataclass
class ModelOptions:
    """model"""
    task: str = option("causal-lm", "what to train", choices=TASKS)
    model: str = option("tiny-gpt2", "HF model id, local HF model dir, or a preset (tiny-gpt2, small-gpt2, gpt2-small; "
                         "lecture-cnn for images)",
                        on_resume="the weights come from the checkpoint, which must fit its shapes (checked)")
    model_dtype: str = option("float32", "the dtype the model's weights are held in: float32, or bfloat16 (half the "
                               "memory; with --peft lora the frozen base is bfloat16 while the adapters and their AdamW "
                               "state stay float32; mixed precision still trains float32 master weights)",
                               choices=MODEL_DTYPES)
    peft: str = option("none", "; ".join(f"{name}: {entry.summary}" for name, entry in PEFT_REGISTRY.items()),
                       choices=PEFT_METHODS)
    objective: str = option(DEFAULT_OBJECTIVE, "what the loss learns (--method is the same option): " + "; ".join(
        f"{name}: {objective.summary}" for name, objective in OBJECTIVE_REGISTRY.items()), choices=OBJECTIVES)
    trust_remote_code: bool = option(False, "allow model/dataset code from the Hub to run (only for sources you trust)")


@dataclass
class DataOptions:
    """data"""
    dataset: str | list[str] = option("builtin", "HF dataset id, local .txt/.jsonl/.json/.parquet file (also .gz or "
                                       ".zst), dir or glob of them, an image folder, or 'builtin' (stdlib docstrings for "
                                       "text, handwritten digits for images); several (causal-lm): a mixture of them",
                                       nargs="+")
    dataset_weights: list[float] = option([], "a mixture's sampling weight per --dataset (empty: equal); they need "
                                           "not sum to 1", nargs="+")
    mixture_stop: str = option("first_exhausted", "a mixture's pass ends when its first source runs out, or when every "
                                "source has run out once (the others start over until then)", choices=MIXTURE_STOPS)
    streaming: bool = option(False, "read the data as a stream (causal-lm): nothing is read or tokenized ahead, each "
                              "rank reads its part of the files; needs --max_steps")
    dataloader_num_workers: int = option(0, "processes that prepare the training batches beside each rank (with "
                                          "--streaming: that tokenize the stream; 0 = the training process)",
                                         on_resume=NEXT_STEP + " (the batches do not depend on it)")
    dataset_config: str = option("", "the dataset's configuration (subset) name, for datasets that have several")
    dataset_split: str = option("", "the split to train on; empty: train, or the only split")
    eval_split: str = option("", "the split to evaluate on; empty: validation or test when present, else "
                              "validation_split of the training split")
    preprocessing_num_workers: int = option(0, "processes that tokenize the data (datasets' num_proc; 0 = this one)")
    text_column: str = option("text", "column holding the text in .jsonl/.parquet/Hub datasets")
    text_sample_by: str = option("paragraph", ".txt files: what one document is (an end-of-text token follows each): "
                                  "a paragraph (text between blank lines, its line breaks kept), a whole file, or each "
                                  "line (line breaks dropped)", choices=TEXT_SAMPLE_BY)
    image_column: str = option("image", "column holding the images (image-classification)")
    label_column: str = option("label", "column holding the class ids (image-classification)")
    data_format: str = option("auto", "text (blocks of concatenated text), chat (a messages column), instruction "
                               "(instruction/input/output), prompt_completion (prompt/completion), preference "
                               "(prompt/chosen/rejected: --method dpo or simpo), prompt (prompts alone: --method grpo), "
                               "or auto: detected from the columns", choices=DATA_FORMATS)
    chat_template: str = option("", "a Jinja chat template file that renders chat and instruction data, replacing the "
                                 "tokenizer's own; saved with the model")
    train_on_prompt: bool = option(False, "SFT: take the loss on every token, not only on the answers and their "
                                    "end-of-turn tokens")
    train_on_reasoning: bool = option(True, "chat SFT: train on the assistant's reasoning (Qwen3's <think> block, "
                                       "gpt-oss's analysis channel) with its answer; false: the answer alone")
    packing: bool = option(True, "SFT: pack examples into blocks of block_size (attention never crosses examples); "
                            "false (--no_packing) pads each batch to its longest example")
    long_examples: str = option("truncate", "SFT examples longer than block_size: truncate or drop (counted either "
                                 "way)", choices=LONG_EXAMPLES)
    max_train_samples: int = option(0, "use only the first N training samples (0 = all)")
    max_eval_samples: int = option(0, "use only the first N held-out samples (0 = all)", on_resume=NEXT_STEP)
    validation_split: float = option(0.05, "fraction held out for evaluation when the data has no validation/test split")
    block_size: int = option(128, "tokens per training sequence (causal-lm)")


@dataclass
class VisionOptions:
    """vision-language models (--task image-text-to-text)"""
    freeze_vision_tower: bool = option(True, "keep the vision tower as loaded (no gradients; under LoRA no adapters "
                                       "on it); --freeze_vision_tower false trains it too")
    freeze_projector: bool = option(False, "keep the projector from image features to the language model as "
                                    "loaded too")
    max_pixels: int = option(0, "resize each image to at most this many pixels, for processors that resize by pixel "
                             "count (Qwen-VL's); 0 = the processor's own")
    min_pixels: int = option(0, "...and at least this many (Qwen-VL's); 0 = the processor's own")
    image_size: int = option(0, "the longest side images are resized to, for processors that resize by it "
                             "(Idefics3's and SmolVLM's longest_edge); 0 = the processor's own")


@dataclass
class TrainingOptions:
    """training"""
    max_steps: int = option(0, "optimizer steps to run; 0 = run num_epochs", on_resume=NEW_END)
    num_epochs: int = option(1, "passes over the training data (used when max_steps is 0)", on_resume=NEW_END)
    per_device_batch_size: int = option(8, "samples per process per micro-batch",
                                        on_resume="the position in the epoch carries over to within one global batch")
    per_device_eval_batch_size: int = option(0, "samples per process per evaluation batch (0 = per_device_batch_size)",
                                             on_resume=NEXT_STEP)
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step")
    optimizer: str = option("adamw", "adamw (decoupled decay on matrices and embeddings only) or adam (L2 decay on "
                             "every parameter, as in the lectures)", choices=OPTIMIZERS)
    learning_rate: float = option(1e-3, "peak learning rate",
                                  on_resume="the rest of the schedule is rescaled to the new peak")
    weight_decay: float = option(0.1, "weight decay (see --optimizer)")
    adam_beta1: float = option(0.9, "Adam beta1")
    adam_beta2: float = option(0.95, "Adam beta2")
    lr_scheduler_type: str = option("cosine_with_min_lr", "a transformers.get_scheduler schedule per optimizer step "
                                     "(linear, cosine, cosine_with_min_lr, constant, constant_with_warmup, polynomial), "
                                     "each after a linear warmup; or step (multiply by lr_gamma after every epoch, like "
                                     "StepLR(step_size=1) stepped once per epoch)", choices=LR_SCHEDULERS)
    warmup_ratio: float = option(0.05, "linear warmup over this fraction of the steps")
    warmup_steps: int = option(0, "linear warmup over this many steps (overrides warmup_ratio when > 0)")
    min_lr_ratio: float = option(0.1, "cosine_with_min_lr decays to learning_rate * min_lr_ratio")
    lr_gamma: float = option(0.5, "the step schedule multiplies the learning rate by this after every epoch")
    max_grad_norm: float = option(1.0, "clip the global gradient norm to this; 0 = no clipping",
                                  on_resume="clipping uses it from the next step")
    seed: int = option(42, "seed for model init, data order and dropout")
    loss_chunk_size: int = option(512, "causal-lm: positions per chunk of the cross-entropy, computed from the output "
                                   "layer's input so that the full [batch, block, vocab] logits never exist (0 = the "
                                   "full logits; same loss either way)", on_resume=NEXT_STEP)
    attn_implementation: str = option("auto", "causal-lm: the attention kernel, by transformers' names: sdpa or eager "
                                       "keep packed examples apart with a [batch, 1, block, block] mask; flex_attention "
                                       "and flash_attention_2 by their position ids alone (no mask, no block^2 memory; "
                                       "CUDA GPUs); auto: the fastest this device and model have, named on the start "
                                       "line", choices=ATTN_IMPLEMENTATIONS, on_resume=NEXT_STEP)
    use_liger_kernel: bool = option(False, "causal-lm, CUDA GPUs: Liger's Triton kernels for the RMSNorm, SwiGLU and "
                                     "rotary embeddings of the families Liger covers (pip install 'finetune[liger]'); "
                                     "the loss stays finetune's chunked cross-entropy (the Trainer's name)",
                                    on_resume=NEXT_STEP)


@dataclass
class OutputOptions:
    """checkpoints and outputs"""
    output_dir: str = option("", "run directory; empty means outputs/<task>-<timestamp>")
    overwrite: bool = option(False, "allow writing into an output_dir that already holds another run")
    checkpoint_every: int = option(0, "sharded checkpoint every N optimizer steps (0 = only at the end)",
                                   on_resume=NEXT_STEP)
    checkpoint_every_epochs: int = option(0, "also a sharded checkpoint after every N epochs (0 = not per epoch)",
                                          on_resume=NEXT_STEP)
    keep_last: int = option(0, "keep only the newest N checkpoints (0 = keep all)", on_resume=NEXT_STEP)
    checkpoint_at_end: bool = option(True, "a sharded checkpoint when training ends, which `finetune resume` can "
                                      "continue; false: the end writes final/ alone (a stop request still saves one)",
                                     on_resume=NEXT_STEP)
    resume_from_checkpoint: str = option("", "'latest' or a checkpoint dir to continue from; 'auto': the newest "
                                          "complete checkpoint when there is one, else start fresh (for job scripts "
                                          "that are requeued)")
    allow_unverified_checkpoint: bool = option(False, "resume from a checkpoint without manifest.json (written elsewhere "
                                                "or by an older finetune): its files cannot be checked for damage")
    max_shard_size: str = option("2GB", "largest safetensors file of the final model dir (RUN_DIR/final); the ranks "
                                  "gather one file's tensors at a time, so this also bounds the memory of the final save",
                                 on_resume="applies to the final model dir")


@dataclass
class LoggingOptions:
    """evaluation and logging"""
    eval_every: int = option(0, "evaluate on the validation split every N steps (0 = only at start and end)",
                             on_resume=NEXT_STEP)
    eval_every_epochs: int = option(0, "also evaluate after every N epochs (0 = not per epoch)", on_resume=NEXT_STEP)
    max_eval_batches: int = option(0, "cap evaluation at N batches per process (0 = the whole validation split)",
                                   on_resume=NEXT_STEP)
    log_every: int = option(1, "write a metrics row (and, with plain logs, a console line) every N optimizer steps",
                            on_resume=NEXT_STEP)
    log_format: str = option("auto", "bar (a progress bar), plain (one line per logged step and per evaluation), or "
                              "auto: bar on a terminal, plain elsewhere or with TQDM_DISABLE=1", choices=LOG_FORMATS,
                             on_resume=NEXT_STEP)
    report_to: str = option("jsonl", "where metrics go, through Accelerate's trackers, one or more comma-separated: "
                             "jsonl (RUN_DIR/metrics.jsonl), tensorboard (RUN_DIR/tensorboard), wandb (a W&B run named "
                             "after the run dir; WANDB_MODE and friends apply), mlflow (an MLflow run; "
                             "MLFLOW_TRACKING_URI applies), or none", on_resume=NEXT_STEP)
    sample_prompt: str = option("The", "prompt for the sample printed from the final causal LM ('' = no sample)",
                                on_resume=NEXT_STEP)
    profile_steps: int = option(0, "record N optimizer steps (after 2 warm-up steps) with torch.profiler into "
                                 "RUN_DIR/profile/ (0 = no profiling)", on_resume=NEXT_STEP)


@dataclass
class LaunchOptions:
    """FSDP and launch (sharding, processes and precision come from `accelerate launch --config_file`;
    `finetune configs` lists them)"""
    ddp_timeout: int = option(1800, "seconds a rank waits for the others in a collective before the run ends, naming "
                               "the ranks that stopped answering (long enough for the main process to prepare data)",
                              on_resume=NEXT_STEP)


# The run config: this module's sections, then the PEFT methods' and the
# objectives' (each section's fields are options; see options.py).
OWN_SECTIONS = (ModelOptions, DataOptions, VisionOptions, TrainingOptions, OutputOptions, LoggingOptions, LaunchOptions)
SECTIONS = (*OWN_SECTIONS[:4], *PEFT_SECTIONS, *OBJECTIVE_SECTIONS, *OWN_SECTIONS[4:])


@dataclass
class TrainConfig(*reversed(SECTIONS)):  # a dataclass takes its bases' fields, the last base's first
    def recorded(self) -> dict[str, Any]:
        """What run_config.yaml keeps: every option but the permission that
        held for one command only (the next resume checks its checkpoint)."""
        return {k: v for k, v in self.to_dict().items() if k != "allow_unverified_checkpoint"}

    def resolved(self) -> "TrainConfig":
        """Fill in defaults that depend on other fields."""
        cfg = dataclasses.replace(self)
        if not cfg.output_dir:
            cfg.output_dir = str(Path("outputs") / f"{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}")
        for name in INPUT_OPTIONS:  # a resume from another working dir reads the same files
            value = getattr(cfg, name)
            setattr(cfg, name, [absolute(v) for v in value] if isinstance(value, list) else absolute(value))
        cfg.reward_funcs = [absolute_reward(spec) for spec in cfg.reward_funcs]
        return cfg

    @property
    def sources(self) -> list[str]:
        """The --dataset values: one, or a mixture's sources."""
        return self.dataset if isinstance(self.dataset, list) else [self.dataset]

    @property
    def source_weights(self) -> list[float]:
        """Each source's share of the examples drawn (summing to 1)."""
        weights = self.dataset_weights or [1.0] * len(self.sources)
        return [round(w / sum(weights), 12) for w in weights]  # 0.6, not 0.6000000000000001 in summary.json

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            if (allowed := f.metadata["choices"]) and getattr(self, f.name) not in allowed:
                raise UsageError(f"{flag(f.name)} {getattr(self, f.name)!r} is not supported; choose one of "
                                 f"{', '.join(allowed)}")
        positive = ["block_size", "per_device_batch_size", "gradient_accumulation_steps", "log_every", "ddp_timeout"]
        non_negative = ["max_pixels", "min_pixels", "image_size", "max_steps", "num_epochs", "warmup_steps", "eval_every", "eval_every_epochs", "max_eval_batches",
                        "profile_steps", "max_train_samples", "max_eval_samples", "preprocessing_num_workers",
                        "dataloader_num_workers",
                        "per_device_eval_batch_size", "checkpoint_every", "checkpoint_every_epochs", "keep_last", "max_grad_norm", "weight_decay",
                        "loss_chunk_size", "max_prompt_length", "log_completions_every"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name} must be > 0, got {getattr(self, name)}; pass a positive value")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise UsageError(f"--{name} must be >= 0, got {getattr(self, name)}; pass 0 or more")
        try:
            byte_count(self.max_shard_size)
        except ValueError:
            raise UsageError(f"--max_shard_size {self.max_shard_size!r} is not a size; write e.g. 2GB, 500MiB or "
                             "2000000000") from None
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed must be between 0 and {2**32 - 1}, got {self.seed}; pass e.g. 42")
        if self.max_steps == 0 and self.num_epochs == 0:
            raise UsageError("both --max_steps and --num_epochs are 0; set one of them to how long to train")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise UsageError(f"--learning_rate must be a positive number, got {self.learning_rate}; pass e.g. 1e-3")
        self._validate_data_sources()
        vision = [name for name in ("max_pixels", "min_pixels", "image_size") if getattr(self, name)]
        if vision and self.task != "image-text-to-text":
            raise UsageError(f"--{vision[0]} resizes a vision-language model's images; pass --task image-text-to-text, "
                             f"or drop --{vision[0]}")
        if self.task == "image-text-to-text" and self.packing:
            raise UsageError("--packing is not built for rows with images (each row is padded); drop --packing")
        if self.max_pixels and self.min_pixels > self.max_pixels:
            raise UsageError(f"--min_pixels {self.min_pixels} is more than --max_pixels {self.max_pixels}; lower it")
        if not 0.0 < self.validation_split < 1.0:
            raise UsageError(f"--validation_split must be between 0 and 1, got {self.validation_split}; pass a fraction such as 0.05")
        if self.model_dtype != "float32" and not REGISTRY[self.task].has_tokenizer:
            raise UsageError(f"--model_dtype {self.model_dtype} is for language models; train {self.task} models in "
                             "float32 (mixed precision comes from the accelerate config)")
        objective = OBJECTIVE_REGISTRY.get(self.objective)
        if objective is not None:  # an unknown name is refused with the other choices below
            if self.task not in objective.tasks:
                fitting = [name for name, o in OBJECTIVE_REGISTRY.items() if self.task in o.tasks]
                raise UsageError(f"--method {self.objective} is for --task {one_of(objective.tasks)}; train "
                                 f"{self.task} models with --method {one_of(fitting)}")
            objective.check(self)
            wanted, given = objective.data_format, FORMATS.get(self.data_format)
            if wanted is None and given is not None and not given.sft:
                owners = [name for name, o in OBJECTIVE_REGISTRY.items() if o.data_format == self.data_format]
                raise UsageError(f"--data_format {self.data_format} is what --method {one_of(owners)} trains on, "
                                 f"not --method {self.objective}; pass --method {owners[0]}, or another --data_format")
            if wanted is not None and self.data_format not in ("auto", wanted):
                raise UsageError(f"--method {self.objective} trains on {FORMATS[wanted].words}, not --data_format "
                                 f"{self.data_format}; pass --data_format {wanted} or auto")
        if self.peft in PEFT_REGISTRY:
            if self.peft != "none" and not REGISTRY[self.task].has_tokenizer:
                raise UsageError(f"--peft {self.peft} is for language models; train {self.task} models with --peft "
                                 "none")
            PEFT_REGISTRY[self.peft].check(self)
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise UsageError(f"--warmup_ratio must be in [0, 1), got {self.warmup_ratio}; pass e.g. 0.03")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UsageError(f"--min_lr_ratio must be between 0 and 1, got {self.min_lr_ratio}; pass e.g. 0.1")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UsageError(f"--{name} must be in [0, 1), got {getattr(self, name)}; pass e.g. 0.9")
        reporters = self.report_to.split(",")
        if not set(reporters) <= set(REPORTERS) or ("none" in reporters and len(reporters) > 1):
            raise UsageError(f"--report_to {self.report_to!r} is not supported; pass one or more of "
                             f"{', '.join(r for r in REPORTERS if r != 'none')}, comma-separated, or none")
        if not 0.0 < self.lr_gamma <= 1.0:
            raise UsageError(f"--lr_gamma must be in (0, 1], got {self.lr_gamma}; pass e.g. 0.5")

    def _validate_data_sources(self) -> None:
        sources, weights = self.sources, self.dataset_weights
        if weights and len(weights) != len(sources):
            raise UsageError(f"--dataset_weights has {len(weights)} weight(s) for {len(sources)} --dataset source(s); "
                             "give one weight per source, in the same order")
        if weights and not (all(math.isfinite(w) and w >= 0 for w in weights) and 0 < sum(weights) < math.inf):
            raise UsageError(f"--dataset_weights {' '.join(f'{w:g}' for w in weights)} must be numbers >= 0 with a "
                             "positive, finite sum; pass e.g. 0.8 0.2")
        if weights and self.mixture_stop == "all_exhausted" and min(weights) / sum(weights) < MIN_SHARE_TO_EXHAUST:
            rare = sources[weights.index(min(weights))]
            raise UsageError(f"--dataset_weights gives {rare} a share of {min(weights) / sum(weights):.3g}: under "
                             "--mixture_stop all_exhausted every source must run out, and one drawn that rarely "
                             "never would; raise its weight, drop the source, or stop at first_exhausted")
        objective = OBJECTIVE_REGISTRY.get(self.objective)
        mixing = [name for name, o in OBJECTIVE_REGISTRY.items() if o.reads_mixtures]
        plain = self.task == "causal-lm" and (objective is None or objective.reads_mixtures)
        images = self.task == "image-text-to-text" and self.objective == "sft"  # streams one source of image rows
        if len(sources) > 1 and not plain:
            raise UsageError(f"a mixture of {len(sources)} sources is for --task causal-lm --method {one_of(mixing)}; "
                             f"train {self.task if self.task != 'causal-lm' else '--method ' + self.objective} on one "
                             "--dataset")
        if self.streaming and not (plain or images):
            raise UsageError(f"--streaming is for --task causal-lm --method {one_of(mixing)}, and for "
                             "--task image-text-to-text --method sft; train "
                             f"{self.task if self.task != 'causal-lm' else '--method ' + self.objective} without it")
        if self.streaming and self.max_steps == 0:
            raise UsageError("--streaming needs --max_steps: a stream has no length to count epochs by; pass "
                             "--max_steps N (an epoch is then one pass, when the stream ends)")
        if self.streaming and self.max_train_samples:
            raise UsageError("--max_train_samples counts a dataset's rows, which a stream does not hold; with "
                             "--streaming, --max_steps sets how much is read")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def tracker_values(self) -> dict[str, Any]:
        """The options as trackers take them: scalars (TensorBoard's hparams
        refuse lists), a list as its values joined by spaces."""
        return {name: " ".join(map(str, value)) if isinstance(value, list) else value
                for name, value in self.to_dict().items()}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _element(hint) -> type:
    """The element type of a list option's type hint (list[float]: float; str | list[str]: str)."""
    lists = [h for h in (typing.get_args(hint) or (hint,)) if typing.get_origin(h) is list] or [hint]
    return typing.get_args(lists[0])[0]


# Options a resume may change, and what the change does (their `on_resume`).
RESUME_MAY_CHANGE = {f.name: f.metadata["on_resume"] for f in dataclasses.fields(TrainConfig)
                     if f.metadata["on_resume"]}
# Options that take several values, and the type of each.
SEVERAL_VALUES = {f.name: _element(get_type_hints(TrainConfig)[f.name]) for f in dataclasses.fields(TrainConfig)
                  if f.metadata["nargs"]}


def one_of(names) -> str:
    """a; a or b; a, b or c."""
    names = list(names)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def flag(name: str) -> str:
    """An option as users spell it on the command line."""
    return "--method" if name == "objective" else f"--{name}"


def resume_changes(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """What a resume changes against the config its checkpoint was written
    with: one line per change it applies; refused when it changes anything else."""
    changed = {name: (saved[name], value) for name, value in cfg.to_dict().items()
               if name in saved and saved[name] != value and name not in RESUME_BOOKKEEPING
               and not (name in INPUT_OPTIONS and absolute(str(saved[name])) == value)}  # recorded relative before
    refused = [f"--{name} ({old!r} -> {new!r})" for name, (old, new) in changed.items() if name not in RESUME_MAY_CHANGE]
    if refused:
        recorded = " ".join(f"--{name} {shlex.join(map(str, old)) if isinstance(old, list) else shlex.quote(str(old))}"
                            for name, (old, _) in changed.items() if name not in RESUME_MAY_CHANGE)
        raise UsageError(f"a resume cannot change {', '.join(refused)}: the checkpoint was made with the old value; "
                         f"resume with the run's own ({recorded}), or start a new run in another --output_dir")
    return [f"--{name} {old!r} -> {new!r}: {RESUME_MAY_CHANGE[name]}" for name, (old, new) in changed.items()]


def config_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(TrainConfig))


def field_types() -> dict[str, type]:
    return get_type_hints(TrainConfig)


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, [f.name for f in config_fields()], n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def coerce(name: str, value: Any) -> Any:
    """Convert a YAML or command-line value to the field's declared type. An
    option that takes several values takes a list (one value for `dataset`
    stays a plain string, as runs have always recorded it)."""
    typ = field_types()[name]
    if name in SEVERAL_VALUES:
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        element = SEVERAL_VALUES[name]
        try:
            if (not values and name == "dataset") or any(isinstance(v, (bool, dict, list)) or v is None
                                                         for v in values):
                raise ValueError
            converted = [element(v) for v in values]
        except (TypeError, ValueError):
            raise UsageError(f"{name}: expected a list of {element.__name__}, got {value!r}; fix the value in the config "
                             "or on the command line") from None
        return converted[0] if name == "dataset" and len(converted) == 1 else converted
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if typ is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        if typ is str and value is None:
            return ""
        return typ(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name}: expected {typ.__name__}, got {value!r}; fix the value in the config or on the command line") from None


# Names the HF Trainer and transformers' run_clm.py use for the same options.
ALIASES = {
    "model_name_or_path": "model", "dataset_name": "dataset", "dataset_config_name": "dataset_config",
    "num_train_epochs": "num_epochs", "per_device_train_batch_size": "per_device_batch_size",
    "save_steps": "checkpoint_every", "save_total_limit": "keep_last", "logging_steps": "log_every",
    "eval_steps": "eval_every", "overwrite_output_dir": "overwrite",
    "lr_scheduler": "lr_scheduler_type",  # this project's own name before the get_scheduler names
    "moe_aux_loss_coef": "router_aux_loss_coef",  # LLaMA-Factory's name
    "method": "objective",  # the flag users know, and what run configs recorded before `objective`
}
# Names that are not options of a run here: what they are, the `accelerate
# launch` options that set what they meant (from the value given), and the
# shipped accelerate config to launch with.
ELSEWHERE = {
    "num_processes": ("an `accelerate launch` option", lambda v: ["--num_processes", v or "2"], "fsdp"),
    "num_machines": ("an `accelerate launch` option", lambda v: ["--num_machines", v or "2"], "multinode"),
    "mixed_precision": ("an `accelerate launch` option", lambda v: ["--mixed_precision", v or "bf16"], "fsdp"),
    "bf16": ("mixed precision, an `accelerate launch` option", lambda v: ["--mixed_precision", "bf16"], "fsdp"),
    "fp16": ("mixed precision, an `accelerate launch` option", lambda v: ["--mixed_precision", "fp16"], "fsdp"),
    "gradient_checkpointing": ("set by the accelerate config here", lambda v: [], "fsdp_activation_checkpointing"),
}


def launch_instead(key: str, value: str, command: list[str]) -> str:
    """`finetune COMMAND` launched with what `--key value` meant, for messages."""
    _, launch_options, config = ELSEWHERE[key]
    return (f"accelerate launch --config_file $(finetune configs --path {config}) "
            + shlex.join([*launch_options(value), "-m", "finetune", *command]))


# What a fine-tune of a pretrained model starts from (the usual HF Trainer values); presets
# trained from scratch keep the dataclass's nanoGPT-style values.
FINE_TUNING_DEFAULTS = dict(optimizer="adamw", learning_rate=5e-5, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                            lr_scheduler_type="linear", warmup_ratio=0.03, min_lr_ratio=0.0)


def canonical_key(key: str, where: str) -> str:
    """Our name for an option given under a Trainer/run_clm name; a one-line error
    for names that belong to `accelerate launch` or its config."""
    if key in ELSEWHERE:
        raise UsageError(f"{where}{key} is {ELSEWHERE[key][0]}; drop it and launch with it, e.g. "
                         f"`{launch_instead(key, '', ['train', '--config', where.removesuffix(': ')])}`")
    return ALIASES.get(key, key)


def from_scratch(model: str) -> bool:
    return any(model in entry.presets for entry in REGISTRY.values())


def defaults_note(cfg: "TrainConfig") -> str:
    """Which set of defaults the run started from, and why (written atop run_config.yaml)."""
    if from_scratch(cfg.model):
        return f"from-scratch defaults (nanoGPT-style), because --model {cfg.model} is a preset built from scratch"
    return f"fine-tuning defaults ({FINE_TUNING_DEFAULTS}), because --model {cfg.model} is a pretrained model"


def fine_tuning_defaults(objective: str, peft: str) -> dict[str, Any]:
    """What a fine-tune of a pretrained model starts from: the usual values, and
    the learning rate of the objective or of the PEFT method."""
    adapters = PEFT_REGISTRY[peft].trains_adapters if peft in PEFT_REGISTRY else False
    rates = OBJECTIVE_REGISTRY[objective].learning_rates if objective in OBJECTIVE_REGISTRY else {}
    rate = rates.get("lora" if adapters else "full") or (PEFT_REGISTRY[peft].learning_rate if adapters else None)
    return {**FINE_TUNING_DEFAULTS, **({"learning_rate": rate} if rate else {})}


# The module names of a mixture of experts' fused experts and routers, which
# peft adapts as parameters, where it cannot apply dropout.
ADAPTED_IN_PLACE = ("experts", "gate", "router")


def names_adapted_in_place(target_modules: str) -> str:
    """The first name in --lora_target_modules that means fused experts or a router ('' if none)."""
    return next((key for key in (k.strip() for k in target_modules.split(","))
                 if key.rsplit(".", 1)[-1] in ADAPTED_IN_PLACE or "experts." in key), "")


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> TrainConfig:
    """YAML file (optional) < command-line overrides. Unknown keys are errors;
    Trainer/run_clm names are read as ours."""
    values: dict[str, Any] = {}
    if path:
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"config file {path} {not_a_file(path)}; pass an existing YAML file to --config")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise UsageError(f"config file {path} is not UTF-8 text (at byte offset {e.start}); fix or replace "
                             "it") from None
        except yaml.YAMLError as e:
            raise UsageError(f"config file {path} is not valid YAML ({str(e).splitlines()[0]}); fix its syntax") from None
        if not isinstance(loaded, dict):
            raise UsageError(f"config file {path} must hold a mapping of option: value; fix its layout")
        known = {f.name for f in config_fields()}
        loaded.pop("launch", None)  # how the run was launched (launch.py): a record, not an option
        loaded.pop("inputs", None)  # what the files it read were (data/fingerprint.py): a record too
        for key, value in loaded.items():
            name = canonical_key(key, f"{path}: ")
            if name not in known:
                raise UsageError(f"unknown key '{key}' in {path}{_suggest(key) or '; see finetune train --help for the keys'}")
            if name in values:
                raise UsageError(f"{path} sets {name} twice (as {key} and under another name); keep one")
            if key == "lr_scheduler" and value == "cosine":
                value = "cosine_with_min_lr"  # what "cosine" meant under the old name
            values[name] = value
    # A file may come from someone else: a permission is the user's own word, on the command line.
    for name, (what, when) in COMMAND_LINE_ONLY.items():
        if path and coerce(name, values.get(name, False)) and overrides.get(name) is not True:
            raise UsageError(f"{path} sets {name}, which {what}; it is taken only from the command line: pass "
                             f"--{name}{when.format(model=values.get('model', 'them'))}")
    own_code = [spec for spec in values.get("reward_funcs") or [] if isinstance(spec, str) and is_user_code(spec)]
    if path and own_code and "reward_funcs" not in overrides:
        raise UsageError(f"{path} names reward functions of your own code ({' '.join(own_code)}), which run only when "
                         f"the command line names them: pass --reward_funcs {' '.join(values['reward_funcs'])}")
    overrides = {ALIASES.get(key, key): value for key, value in overrides.items()}
    values.update(overrides)
    # An option the run's objective or PEFT method does not read: refused when the command line
    # gives it, or a file sets it to other than its default (a run config records every option).
    objective = values.get("objective", TrainConfig.objective)
    peft = values.get("peft", TrainConfig.peft)
    defaults = TrainConfig()
    for chosen, option_name, readers, fallback in ((peft, "peft", PEFT_READERS, "lora"),
                                                   (objective, "method", OBJECTIVE_READERS, None)):
        unread = [name for name, users in readers.items() if chosen not in users and (
            name in overrides or (name in values and coerce(name, values[name]) != getattr(defaults, name)))]
        if unread:
            users = readers[unread[0]]
            add = fallback if fallback in users else users[0]
            given = f"--{unread[0]}" if unread[0] in overrides else f"{path} sets {unread[0]}, which"
            raise UsageError(f"{given} is read by --{option_name} {one_of(users)}, not by --{option_name} "
                             f"{chosen}; drop {'it' if unread[0] not in overrides else given}, or pass "
                             f"--{option_name} {add}")
    if "lora_dropout" in overrides and coerce("lora_dropout", overrides["lora_dropout"]) and \
            (in_place := names_adapted_in_place(str(values.get("lora_target_modules", "")))):
        raise UsageError(f"--lora_dropout applies to linear layers, and --lora_target_modules names {in_place} (fused "
                         "experts or a router), which peft adapts in place without dropout; pass --lora_dropout 0, "
                         "or name linear layers alone")
    # The objective's own task (a reward model's) unless the file or the command line names one.
    own = OBJECTIVE_REGISTRY[objective].defaults if objective in OBJECTIVE_REGISTRY else {}
    task = values.get("task", own.get("task", TrainConfig.task))
    if task in REGISTRY:  # the task's own defaults; anything set in the file or on the command line wins
        entry = REGISTRY[task]
        model = values.get("model", entry.defaults.get("model", TrainConfig.model))
        fine_tuning = {} if from_scratch(model) else fine_tuning_defaults(objective, peft)
        values = {**entry.defaults, **own, **fine_tuning, **values}
    cfg = TrainConfig(**{k: coerce(k, v) for k, v in values.items()})
    cfg.validate()
    return cfg
