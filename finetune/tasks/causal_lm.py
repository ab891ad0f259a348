"""Causal language modelling: text cut into token blocks, or instruction/chat
examples with labels on the answers (packed or padded); next-token
cross-entropy on the targets, perplexity."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from finetune import models
from finetune.models import attention
from finetune.models.gguf import converted_dir, is_gguf
from finetune.data.chat import PadCollator, build_sft_splits, load_chat_template, pad_id
from finetune.data.mixture import MixedRows
from finetune.data.sources import limit_samples
from finetune.data.text import LoadedSources, load_raw_data, load_sources, tokenize_and_group
from finetune.data.tokenizer import load_preset_tokenizer, save_bpe_tokenizer
from finetune.backends.base import Backend
from finetune.collectives import broadcast_from_main, check_same_layout, main_process_first
from finetune.config import one_of
from finetune.data.formats import FORMATS, SFT_FORMATS
from finetune.objectives import REGISTRY as OBJECTIVES
from finetune.errors import UsageError
from finetune.presets import GPT2_PRESETS
from finetune.shard_loading import OwnShards
from finetune.tasks.base import LossSum, Scored, Task, TaskData
from finetune.signals import NoSignal
from finetune.tasks.lm_loss import IGNORE, can_chunk, chunked_head_loss, full_logits_nll, next_token_targets
from finetune.tasks.router import Routers


def attention_inputs(batch: dict, attn_implementation: str) -> dict:
    """Model inputs that keep the examples of a packed (or padded) row apart.

    Every example starts at position id 0. Each token may attend to the tokens
    before it in its own example only. Under sdpa and eager attention that is an
    explicit [B, 1, T, T] block-diagonal causal mask, which transformers passes
    to the kernel untouched: exact on every model and device. flex_attention
    and flash_attention_2 get the position ids alone, from which transformers
    builds the same document mask without a dense tensor (finetune/models/attention.py).
    Padding (position 0 each) is a one-token example of its own: never seen by
    real tokens, and no target. Plain text blocks have no position ids and keep
    the model's own causal mask."""
    if "position_ids" not in batch:
        return {}
    positions = batch["position_ids"]
    if attn_implementation in attention.WITHOUT_MASK:  # transformers keeps the examples apart by their position ids
        return {"position_ids": positions}
    example = (positions == 0).cumsum(dim=-1)
    width = positions.size(1)
    causal = torch.ones(width, width, dtype=torch.bool, device=positions.device).tril()
    allowed = ((example[:, :, None] == example[:, None, :]) & causal)[:, None]
    if attn_implementation == "eager":  # eager attention adds the mask to the scores
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=positions.device)
        allowed = mask.masked_fill(~allowed, torch.finfo(torch.float32).min)
    elif attn_implementation != "sdpa":
        raise UsageError(f"packed and padded SFT batches need sdpa, eager, flex_attention or flash_attention_2, not "
                         f"{attn_implementation}; pass --attn_implementation sdpa")
    return {"attention_mask": allowed, "position_ids": positions}


class Scores(NamedTuple):
    """One forward's loss terms."""
    nll: torch.Tensor         # per position [B, T], 0 where there is no target (not differentiable when chunked)
    total: torch.Tensor       # their sum, what backward starts from
    has_target: torch.Tensor  # [B, T] bool
    tokens: torch.Tensor      # real (not padding) tokens


def model_config(model):
    return getattr(model, "module", model).config  # under DDP the HF model is .module


def model_inputs(model, batch: dict) -> dict:
    """A training or scoring forward's inputs: no KV cache (never reused), and
    the mask that keeps a batch's examples apart."""
    return {"input_ids": batch["input_ids"], "use_cache": False,
            **attention_inputs(batch, model_config(model)._attn_implementation)}


# Data this large takes a while to read through (tens of seconds a GB on one core): the console says what is going on.
LONG_DATA_BYTES = 10 * 2**20


def say_when_long(accelerator: Accelerator, doing: str, *splits: Dataset) -> None:
    """One line on the main process before a long pass over in-memory data."""
    size = sum(split.data.nbytes for split in splits)
    if size >= LONG_DATA_BYTES:
        rows = sum(len(split) for split in splits)
        accelerator.print(f"{doing} {rows:,} example(s), {size / 2**20:,.1f} MiB ...")


class CausalLM(Task):
    name = "causal-lm"
    metric_name = "perplexity"
    throughput_key = "tokens_per_sec"
    batch_size_options = "--per_device_batch_size/--block_size"
    routers: Routers | None = None  # a mixture of experts' (tasks/router.py)
    watches_routers: bool = True     # this loss reports expert load and adds the load-balancing loss

    def targets(self, batch: dict) -> int:
        return int((next_token_targets(batch.get("labels", batch["input_ids"])) != IGNORE).sum())

    def build(self, accelerator: Accelerator, backend: Backend, run_dir: Path) -> tuple[PreTrainedModel, TaskData]:
        """The main process goes first and fills the caches (datasets, a GGUF
        conversion); the run dir gets nothing but a preset's tokenizer before
        every check has passed."""
        cfg = self.cfg
        if is_gguf(cfg.model):
            self.model_source = str(main_process_first(accelerator, lambda: converted_dir(cfg.model)))
        mixed = cfg.streaming or len(cfg.sources) > 1
        if mixed:
            loaded = main_process_first(accelerator, lambda: load_sources(
                cfg, accelerator.process_index, accelerator.num_processes,
                tokenizer_sample=cfg.model in GPT2_PRESETS and accelerator.is_main_process))
            raw, data_format = DatasetDict(train=loaded.sample), "mixture"
        else:
            raw, data_format = main_process_first(accelerator, self._raw_data)
        if accelerator.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
        from_main = self._loading_plan(accelerator, backend)
        # Packed or padded rows hold several sequences, which the attention must keep apart.
        self.rows_hold_examples = mixed or data_format != "text"
        tokenizer, model = self._tokenizer_and_model(raw["train"], accelerator, run_dir, from_main)
        self._loaded(accelerator, backend, model, from_main)
        if mixed:
            data = self._mixed_data(loaded, tokenizer, accelerator.process_index)
        else:
            say_when_long(accelerator, "tokenizing", *raw.values())
            splits, description = main_process_first(accelerator, lambda: self._splits(raw, data_format, tokenizer))
            data = TaskData(splits["train"], splits["validation"], tokenizer, description,
                            collate=self._collate(data_format, tokenizer), data_format=data_format)
        data.description += f"; {attention.describe(self.attention)}"
        self.routers = Routers.of(model, cfg) if self.watches_routers else None
        if self.routers is not None:
            self.step_metrics = self.routers.step_metrics
        return model, data

    def _loading_plan(self, accelerator: Accelerator, backend: Backend) -> bool:
        """Whether the weights come from the main process: with
        fsdp_cpu_ram_efficient_loading only it reads them; the others build the
        architecture and receive their shards in `prepare`."""
        from_main = backend.weights_from_main_process(accelerator)
        if self.peft.each_rank_loads_the_base:  # on one process too: `prepare` would broadcast its 4-bit weights
            backend.leave_loading_to_the_ranks(accelerator)
            from_main = False
        return from_main

    def _loaded(self, accelerator: Accelerator, backend: Backend, model: PreTrainedModel, from_main: bool) -> None:
        """What follows loading the weights on the main process alone."""
        if not from_main:
            return
        if accelerator.mixed_precision != "no":
            models.upcast_trainable(model, written=accelerator.is_main_process and self.own_shards is None)
        check_same_layout(accelerator, model)
        self.peft.base_record = broadcast_from_main(self.peft.base_record)  # a preset's fingerprint needs its weights
        if self.own_shards is not None:
            backend.leave_loading_to_the_ranks(accelerator)

    def _mixed_data(self, loaded: LoadedSources, tokenizer: PreTrainedTokenizerBase, rank: int) -> TaskData:
        """A stream's or a mixture's rows (mixture.py): held-out rows built
        source by source, training rows drawn from all of them by weight. A
        stream reads this rank's part as training goes; a mixture without
        --streaming is drawn once, in full (the same on every rank), and then
        shuffled each epoch like any map-style data."""
        cfg, sources = self.cfg, loaded.sources
        rows = MixedRows(loaded, tokenizer, cfg)
        validation = rows.held_out()
        weights = " ".join(f"{s.weight:.3g}" for s in sources)
        what = (f"{len(sources)} sources ({', '.join(rows.formats)}) drawn with weights {weights} until "
                f"{cfg.mixture_stop.replace('_', ' ')}" if len(sources) > 1 else f"{rows.formats[0]} data")
        unit = {"blocks": f"blocks of {cfg.block_size}", "packed": f"packed blocks of {cfg.block_size}",
                "examples": "examples"}[rows.mode]
        data = TaskData(None, validation, tokenizer, "", collate=rows.collate, data_format=rows.data_format,
                        source_names=list(cfg.sources))
        if cfg.streaming:
            data.stream = rows.stream(rank, workers=cfg.dataloader_num_workers)
            data.description = f"{what}, streamed as {unit}; {len(validation)} held-out {unit}"
            return data
        stream = rows.stream(rank=0, workers=cfg.dataloader_num_workers)
        data.train = Dataset.from_list([row for row, _ in stream.rows(0)])
        stream.close()
        if len(data.train) == 0:
            raise UsageError(f"no training row is left of {', '.join(cfg.sources)} after fitting to --block_size "
                             f"{cfg.block_size}; add examples or lower --block_size")
        data.description = f"{what}: {len(data.train)} train / {len(validation)} validation {unit}"
        return data

    def held_out(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> Scored:
        self._check_block_size(model)
        if self.cfg.streaming or len(self.cfg.sources) > 1:
            loaded = load_sources(self.cfg, rank=0, world_size=1)
            rows = MixedRows(loaded, tokenizer, self.cfg)
            return Scored(rows.held_out(), rows.collate, sum(len(held) for held in loaded.validation))
        raw, data_format = self._raw_data(scoring=True)
        rows = self._splits(DatasetDict(validation=raw["validation"]), data_format, tokenizer)[0]["validation"]
        return Scored(rows, self._collate(data_format, tokenizer), len(raw["validation"]))

    @staticmethod
    def _collate(data_format: str, tokenizer: PreTrainedTokenizerBase) -> Callable | None:
        """Text blocks all have block_size tokens; SFT rows are padded per batch."""
        return None if data_format == "text" else PadCollator(pad_id(tokenizer))

    def _raw_data(self, data_format: str = "", scoring: bool = False) -> tuple[DatasetDict, str]:
        """The data's splits and format; `scoring`: for `finetune evaluate`, which scores text alone."""
        cfg = self.cfg
        raw, data_format = load_raw_data(cfg.dataset, data_format or cfg.data_format, cfg.text_column,
                                         cfg.validation_split, cfg.seed, config=cfg.dataset_config,
                                         split=cfg.dataset_split, eval_split=cfg.eval_split,
                                         sample_by=cfg.text_sample_by, objective=cfg.objective)
        kind = FORMATS.get(data_format)
        if scoring and kind and not kind.sft:
            raise UsageError(f"finetune evaluate scores perplexity on text, and --dataset {cfg.dataset} holds "
                             f"{kind.words}, which have none to score; pass text, chat or prompt/completion data")
        if kind and not kind.sft and OBJECTIVES[cfg.objective].data_format != data_format:
            owners = [name for name, objective in OBJECTIVES.items() if objective.data_format == data_format]
            raise UsageError(f"--dataset {cfg.dataset} holds {kind.words}, which --method {cfg.objective} does not "
                             f"train on; pass --method {one_of(owners)}, or give it the columns of "
                             f"{', '.join(SFT_FORMATS)} data")
        return limit_samples(raw, cfg.max_train_samples, cfg.max_eval_samples), data_format

    def _splits(self, raw: DatasetDict, data_format: str, tokenizer: PreTrainedTokenizerBase) -> tuple[DatasetDict, str]:
        cfg = self.cfg
        if data_format == "text":
            blocks = tokenize_and_group(raw, tokenizer, cfg.block_size, cfg.preprocessing_num_workers)
            return blocks, f"{' / '.join(f'{len(rows)} {name}' for name, rows in blocks.items())} blocks of {cfg.block_size}"
        load_chat_template(tokenizer, cfg.chat_template, data_format, cfg.model)
        return build_sft_splits(raw, tokenizer, data_format, cfg.block_size, cfg.train_on_prompt, cfg.packing,
                                cfg.long_examples, cfg.preprocessing_num_workers, cfg.train_on_reasoning)

    def _tokenizer_and_model(self, raw_train: Dataset, accelerator: Accelerator, run_dir: Path, from_main: bool):
        """A preset trains its own tokenizer on the training text (once, on the
        main process, saved with the run); anything else brings its tokenizer.

        With fsdp_cpu_ram_efficient_loading (`from_main`), the ranks build the model without
        its weights. When --model is a dir of safetensors files, each rank reads
        its own shards after `prepare` (finetune/shard_loading.py); otherwise
        the main process loads the weights and `prepare` sends them."""
        cfg = self.cfg
        if cfg.model in GPT2_PRESETS:
            tokenizer_dir = run_dir / "tokenizer"
            # A resume keeps the run's own; a new run (--overwrite too) trains on its own text.
            resuming = bool(cfg.resume_from_checkpoint) and (tokenizer_dir / "tokenizer.json").is_file()
            if accelerator.is_main_process and not resuming:
                say_when_long(accelerator, f"training the {cfg.model} tokenizer on", raw_train)
                save_bpe_tokenizer(raw_train, GPT2_PRESETS[cfg.model]["vocab_size"], tokenizer_dir)
            accelerator.wait_for_everyone()
            tokenizer = load_preset_tokenizer(tokenizer_dir, cfg.model)
            model = self.base_model(tokenizer, weights_here=accelerator.is_main_process or not from_main)
        else:
            model = self._pretrained_weights(accelerator, from_main)
            try:
                tokenizer = AutoTokenizer.from_pretrained(self.model_source, trust_remote_code=cfg.trust_remote_code)
            except (OSError, ValueError) as e:
                raise UsageError(f"--model {cfg.model} has no usable tokenizer ({str(e).splitlines()[0]}); "
                                 "save one next to the model with tokenizer.save_pretrained") from None
        if tokenizer.eos_token_id is None:
            raise UsageError(f"the tokenizer of --model {cfg.model} has no end-of-text token; set eos_token and save it again")
        if len(tokenizer) > model.config.get_text_config().vocab_size:
            raise UsageError(f"the tokenizer has {len(tokenizer)} tokens but --model {cfg.model} only "
                             f"{model.config.get_text_config().vocab_size}; use the tokenizer the model was trained with")
        self._check_block_size(model)
        return tokenizer, self._made_trainable(model, accelerator, from_main)

    def _pretrained_weights(self, accelerator: Accelerator, from_main: bool) -> PreTrainedModel:
        """--model's weights: read here, or by each rank from its own shards
        after `prepare` (finetune/shard_loading.py), or sent by the main process."""
        cfg = self.cfg
        if from_main:
            config = self.configured(models.load_config(self.model_source, cfg.trust_remote_code,
                                                        ", ".join(self.entry.presets)))
            self.own_shards = OwnShards.for_model(self.model_source, config, self.entry.auto(),
                                                  cfg.trust_remote_code, getattr(torch, cfg.model_dtype))
        weights_here = not from_main or (accelerator.is_main_process and self.own_shards is None)
        return self.base_model(None, weights_here)

    def _made_trainable(self, model: PreTrainedModel, accelerator: Accelerator, from_main: bool) -> PreTrainedModel:
        """The model with its fused activations, attention kernel and PEFT adapters."""
        cfg = self.cfg
        models.fuse_activations(model)
        self.attention = attention.use_attention(model, cfg.attn_implementation, self.rows_hold_examples)
        if cfg.use_liger_kernel:
            attention.use_liger_kernels(model)
        return self.peft.wrap(model, self.model_source, accelerator,
                              record_base=accelerator.is_main_process or not from_main)

    def base_model(self, tokenizer: PreTrainedTokenizerBase | None, weights_here: bool = True) -> PreTrainedModel:
        """The weights a run starts from: a preset built from the seed (the same on
        every rank and in every later export), or --model's; only the
        architecture unless `weights_here`."""
        dtype = getattr(torch, self.cfg.model_dtype)
        if self.cfg.model in GPT2_PRESETS:
            config = models.gpt2_config(GPT2_PRESETS[self.cfg.model], tokenizer.bos_token_id, tokenizer.eos_token_id)
            if not weights_here:
                return models.placeholder_model(config, self.entry.auto(), dtype, trust_remote_code=False)
            set_seed(self.cfg.seed)
            return models.build_gpt2(config).to(dtype)
        return self.pretrained_model(weights_here)

    def _check_block_size(self, model: PreTrainedModel) -> None:
        positions = model.config.get_text_config().max_position_embeddings  # a vision-language model's: its text model's
        if self.cfg.block_size > positions:
            raise UsageError(f"--block_size {self.cfg.block_size} is longer than the model's {positions} positions; "
                             "lower --block_size")

    def loss(self, model, batch: dict) -> LossSum:
        if self.routers is None:
            scores = self._forward(model, batch)
            return LossSum(total=scores.total, units=scores.tokens)
        mask = batch.get("attention_mask")  # [B, T]: the real tokens
        with self.routers.watching(mask) as routing:
            scores = self._forward(model, batch)
        added, metrics = self.routers.terms(routing, mask, targets=scores.has_target.sum())
        return LossSum(total=scores.total if added is None else scores.total + added, units=scores.tokens,
                       metrics=metrics)

    def step_means(self, sums: dict, count: float) -> dict:
        if self.routers is None:
            return super().step_means(sums, count)
        return self.routers.step_means(sums, count)

    def no_signal_checks(self) -> list[NoSignal]:
        return [*super().no_signal_checks(), *(self.routers.no_signal_checks() if self.routers else [])]

    def summary_facts(self) -> dict:
        return {**super().summary_facts(), **(self.routers.summary() if self.routers else {})}

    def inputs(self, model, batch: dict) -> dict:
        """What a scoring or training forward takes of a batch (model_inputs)."""
        return model_inputs(model, batch)

    def _forward(self, model, batch: dict) -> Scores:
        """The NLL comes from the output layer's input a chunk at a time
        (lm_loss.py) unless --loss_chunk_size is 0 or the model's head is not
        one the chunked loss reproduces."""
        labels = batch.get("labels", batch["input_ids"])
        targets = next_token_targets(labels)
        inputs = model_inputs(model, batch)
        tokens = (batch["attention_mask"].sum() if "attention_mask" in batch
                  else torch.tensor(labels.numel(), device=labels.device))  # beside the loss, on the GPU too
        chunked = (chunked_head_loss(model, inputs, targets, self.cfg.loss_chunk_size)
                   if self.cfg.loss_chunk_size and can_chunk(model) else None)
        if chunked is None:
            nll = full_logits_nll(model(**inputs).logits, targets)
            return Scores(nll, nll.sum(), targets != -100, tokens)
        total, nll = chunked
        return Scores(nll, total, targets != -100, tokens)

    @torch.no_grad()
    def evaluate(self, model, loader, accelerator: Accelerator) -> dict[str, Any]:
        """Every rank runs the same number of batches (FSDP forwards are collective);
        `gather_for_metrics` drops the samples the distributed sampler repeated.
        The loss is the mean over every target token of the split."""
        metric = self.metric(accelerator)
        was_training = model.training
        model.eval()
        for i, batch in enumerate(loader):
            if self.cfg.max_eval_batches and i >= self.cfg.max_eval_batches:
                break
            scores = self._forward(model, batch)
            nll_sum, counts = accelerator.gather_for_metrics((scores.nll.sum(dim=1), scores.has_target.sum(dim=1)))
            metric.add_batch(nll_sum=nll_sum.double().cpu().tolist(), num_tokens=counts.cpu().tolist())
        model.train(was_training)
        return metric.compute()
