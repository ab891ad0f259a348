"""finetune: fully sharded (FSDP) fine-tuning through Hugging Face Accelerate.

    accelerate launch --config_file $(finetune configs --path fsdp) -m finetune train [OPTIONS]
    finetune resume RUN_DIR [OPTIONS]       continue a run, relaunched as it was launched
    finetune export CHECKPOINT_OR_RUN_DIR --output DIR [--dtype float32|bfloat16|float16]
    finetune generate MODEL --prompt TEXT [--chat]
    finetune evaluate MODEL --dataset ID_OR_PATH   perplexity or accuracy
    finetune estimate-memory --model NAME_OR_PATH --num_processes N [--peft lora --lora_r R]
    finetune configs [--path NAME]          the accelerate configs shipped with finetune

Bad input ends with one line naming the problem and the fix, and exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import os
import sys
from pathlib import Path

from finetune.options import names as section_options, title as section_title
from finetune.config import (ALIASES, DATA_OPTIONS, ELSEWHERE, FINE_TUNING_DEFAULTS, SECTIONS,
                             TEXT_SAMPLE_BY_OF_OLDER_RUNS,
                             SEVERAL_VALUES, TrainConfig, byte_count, coerce, config_fields, field_types,
                             launch_instead, load_config)
from finetune.errors import NotDistributed, RankLost, Stopped, UsageError, missing_or_odd
from finetune.launch_request import no_deepspeed_engine
from finetune.models.attention import IMPLEMENTATIONS as ATTN_IMPLEMENTATIONS
from finetune.objectives import OBJECTIVES, READERS as OBJECTIVE_READERS, REGISTRY as OBJECTIVE_REGISTRY
from finetune.objectives.base import GENERATION_ENGINES, ReferenceOptions
from finetune.objectives.rewards import absolute_reward, is_user_code
from finetune.peft import PEFT_METHODS, READERS as PEFT_READERS, REGISTRY as PEFT_REGISTRY
from finetune.tasks import REGISTRY
from finetune import json_text


def _option_groups() -> dict[str, tuple[str, ...]]:
    """`train --help` in groups, one per section of the config, each titled with
    the objectives or PEFT methods that read it. The sharding itself is set by
    the accelerate config, not by options."""
    groups = {}
    for section in SECTIONS:
        names = section_options(section)
        users = [f"--{flag} {', '.join(readers[names[0]])}" for flag, readers in
                 (("method", OBJECTIVE_READERS), ("peft", PEFT_READERS)) if names[0] in readers]
        groups[section_title(section) + (f" ({users[0]})" if users else "")] = names
    return groups


OPTION_GROUPS = _option_groups()


def _add_config_options(parser: argparse.ArgumentParser, config_file: bool = True) -> None:
    if config_file:
        parser.add_argument("--config", metavar="FILE.yaml", help="run config file (Trainer/run_clm names accepted "
                                                                  "too); command-line options override it")
    defaults = TrainConfig()
    types = field_types()
    by_title = {title: parser.add_argument_group(title) for title in OPTION_GROUPS}
    groups = {name: by_title[title] for title, names in OPTION_GROUPS.items() for name in names}
    for f in config_fields():
        group = groups[f.name]
        default = getattr(defaults, f.name)
        fine_tuning = (f"; fine-tuning a pretrained model: {FINE_TUNING_DEFAULTS[f.name]!r}"
                       if f.name in FINE_TUNING_DEFAULTS else "")
        if f.name == "learning_rate":
            fine_tuning += "".join(f", with --peft {name}: {entry.learning_rate!r}"
                                   for name, entry in PEFT_REGISTRY.items() if entry.trains_adapters) + "".join(
                f"; --method {name}: {o.learning_rates['full']!r}, with LoRA {o.learning_rates['lora']!r}"
                for name, o in OBJECTIVE_REGISTRY.items() if o.learning_rates)
        by_task = "".join(f"; {task}: {entry.defaults[f.name]!r}" for task, entry in REGISTRY.items()
                          if f.name in entry.defaults) + "".join(
            f"; --method {name}: {o.defaults[f.name]!r}" for name, o in OBJECTIVE_REGISTRY.items() if f.name in o.defaults)
        help_text = f"{f.metadata['help']} (default: {default!r}{fine_tuning}{by_task})".replace("%", "%%")
        kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text, choices=f.metadata.get("choices"))
        names = [f"--{f.name}", *(f"--{alias}" for alias, name in ALIASES.items() if name == f.name)]
        if types[f.name] is bool:
            group.add_argument(*names, nargs="?", const=True, metavar="true|false", **kwargs)
            if f.name == "packing":
                group.add_argument("--no_packing", dest="packing", action="store_const", const=False,
                                   default=argparse.SUPPRESS, help="same as --packing false")
        elif f.metadata.get("nargs"):
            group.add_argument(*names, nargs=f.metadata["nargs"], metavar=SEVERAL_VALUES[f.name].__name__.upper(),
                               **kwargs)
        else:
            group.add_argument(*names, metavar=types[f.name].__name__.upper(), **kwargs)


# The train options `finetune evaluate` takes to rebuild the held-out data as the run built it.
# A mixture's weights and a stream are how a run read its training data: evaluation scores one source.
EVALUATE_DATA_OPTIONS = tuple(name for name in DATA_OPTIONS if name not in ("dataset_split", "eval_split",
                                                                           "dataset_weights", "mixture_stop",
                                                                           "streaming"))


def _checked(convert, accepts, expected: str, rule: str):
    """An argparse type: `convert` the text, then require `accepts(value)`."""
    def check(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value
    return check


positive_int = _checked(int, lambda v: v > 0, "a whole number", "> 0")
non_negative_int = _checked(int, lambda v: v >= 0, "a whole number", ">= 0")
non_negative_float = _checked(float, lambda v: v >= 0, "a number", ">= 0")
fraction = _checked(float, lambda v: 0.0 < v < 1.0, "a number between 0 and 1", "between 0 and 1")
fraction_or_one = _checked(float, lambda v: 0.0 < v <= 1.0, "a number", "in (0, 1]")


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(text)
    return text.lower() == "true"


true_or_false = _checked(_boolean, lambda v: True, "true or false", "true or false")


def byte_size(text: str) -> int:
    """80GB, 80GiB, 500MB or a plain number of bytes."""
    try:
        return byte_count(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 2GB, 500MiB or 2000000000") from None


class _Parser(argparse.ArgumentParser):
    """argparse, but bad options are UsageErrors (one line, exit 2), no silent
    prefix matching (--max_step is a typo, not --max_steps), and the options it
    knows listed for suggestions."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    @property
    def known_options(self) -> list[str]:
        return [option for action in self._actions for option in action.option_strings]

    def error(self, message: str):
        raise UsageError(f"{message}; see `{self.prog} --help`")


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse, naming the subcommand's help (and the closest option) for unknown options."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args, unknown = parser.parse_known_args(argv)
    args.argv = argv
    if unknown:
        options = [o for o in args.subparser.known_options if o.startswith("--")]
        first = next((a for a in unknown if a.startswith("--")), unknown[0])
        if first.startswith("--") and first[2:].split("=")[0] in ELSEWHERE:
            raise UsageError(launch_option_message(args.argv, args.argv.index(first)))
        close = difflib.get_close_matches(first.split("=")[0], options, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        what = "unknown option" if first.startswith("-") else "unexpected argument"
        raise UsageError(f"{what} {first}{hint}; see `finetune {args.command} --help`")
    return args


def launch_option_message(argv: list[str], index: int) -> str:
    """For a launch option typed after the command: the user's own command,
    launched with it, so that the fix runs as printed."""
    key, _, value = argv[index][2:].partition("=")
    rest = argv[:index] + argv[index + 1:]
    if not value and index + 1 < len(argv) and not argv[index + 1].startswith("-"):
        value, rest = argv[index + 1], argv[:index] + argv[index + 2:]
    return f"--{key} is {ELSEWHERE[key][0]}; run `{launch_instead(key, value, rest)}`"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="finetune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add_command in (_add_train, _add_resume, _add_export, _add_generate, _add_evaluate, _add_configs,
                        _add_estimate_memory):
        add_command(sub)
    return parser


def _add_train(sub) -> None:
    train = sub.add_parser("train", help="fine-tune a model (launch with accelerate launch for FSDP)")
    _add_config_options(train)
    train.add_argument("--dry_run", action="store_true",
                       help="check the options, the paths they name, the run dir and the launch (processes, "
                            "backend, mesh), then exit without loading a model or data or writing anything "
                            "(default: False)")
    train.set_defaults(func=cmd_train, subparser=train)


def _add_resume(sub) -> None:
    resume = sub.add_parser("resume", help="continue a run from its latest checkpoint, with optional overrides")
    resume.add_argument("run_dir", help="a run directory holding run_config.yaml and checkpoints/")
    relaunch = resume.add_argument_group(
        "relaunch (typed in a plain shell, resume relaunches the run under accelerate launch as run_config.yaml "
        "records it; under a launcher it runs in place)")
    relaunch.add_argument("--num_processes", type=positive_int, default=None,
                          help="relaunch on this many processes instead of the recorded number (default: None)")
    relaunch.add_argument("--no_relaunch", action="store_true",
                          help="resume in this one process even though the run was launched (default: False)")
    _add_config_options(resume, config_file=False)
    resume.set_defaults(func=cmd_resume, subparser=resume)


def _add_export(sub) -> None:
    export = sub.add_parser("export", help="merge a sharded checkpoint into a HF model dir, or write a GGUF file "
                                           "(one process, CPU)")
    export.add_argument("source", metavar="CHECKPOINT_OR_RUN_DIR",
                        help="a checkpoints/step_NNNNNN dir, or a run dir (its newest complete checkpoint); "
                             "with --format gguf also a model dir (a run's final/, an export)")
    export.add_argument("--output", required=True, metavar="DIR_OR_FILE",
                        help="the model dir to write; with --format gguf, the NAME.gguf file")
    export.add_argument("--format", choices=["safetensors", "gguf"], default="safetensors",
                        help="a HF model dir in safetensors, or one GGUF file for llama.cpp / Ollama (Llama, "
                             "SmolLM2, Mistral, Qwen2, GPT-2) (default: 'safetensors')")
    export.add_argument("--gguf_type", choices=["f16", "bf16", "q8_0"], default=None,
                        help="--format gguf: how matrices are stored; vectors stay float32 (default: 'f16')")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="--format safetensors: dtype of the stored weights (default: 'float32')")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty --output (default: False)")
    export.add_argument("--max_shard_size", type=byte_size, default="2GB",
                        help="split the weights into files of at most this size (default: '2GB')")
    export.add_argument("--model", default=None, metavar="NAME_OR_PATH",
                        help="HF model dir or id for config and tokenizer, for checkpoints not written by finetune; "
                             "for a LoRA run, the base to merge into (default: the checkpoint's own model_config/, "
                             "and a LoRA run's recorded --model, checked against the base it was trained on)")
    export.add_argument("--allow_unverified_checkpoint", action="store_true",
                        help="export a checkpoint without manifest.json (written elsewhere, e.g. by accelerator."
                             "save_state, or by an older finetune): its files cannot be checked (default: False)")
    export.add_argument("--trust_remote_code", action="store_true",
                        help="LoRA runs whose base has its own code: let it run to rebuild the base (only for bases "
                             "you trust; never taken from the run's files) (default: False)")
    lora_output = export.add_mutually_exclusive_group()
    lora_output.add_argument("--merge", action="store_true",
                             help="LoRA runs: a full HF model dir, the adapters merged into the base (the default)")
    lora_output.add_argument("--adapter_only", action="store_true",
                             help="LoRA runs: adapter_config.json + adapter_model.safetensors, for "
                                  "PeftModel.from_pretrained(base, DIR) (default: False)")
    export.set_defaults(func=cmd_export, subparser=export)


def _add_generate(sub) -> None:
    generate = sub.add_parser("generate", help="generate text from a model dir")
    generate.add_argument("model_dir", help="an exported model dir, a run's final/, or a .gguf file")
    generate.add_argument("--prompt", required=True, help="text to continue, or with --chat the user's message")
    generate.add_argument("--chat", action="store_true",
                          help="render the prompt as a user turn with the model's chat template and print the answer "
                               "(default: False)")
    generate.add_argument("--max_new_tokens", type=positive_int, default=40, help="tokens to generate (default: 40)")
    generate.add_argument("--temperature", type=non_negative_float, default=0.0,
                          help="sample with this temperature; 0 decodes greedily (default: 0.0)")
    generate.add_argument("--top_p", type=fraction_or_one, default=1.0,
                          help="sample from the smallest set of tokens with this probability mass (default: 1.0)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    generate.add_argument("--image", action="append", default=[], metavar="PATH",
                          help="an image the prompt is about (a vision-language model; repeat for several)")
    generate.set_defaults(func=cmd_generate, subparser=generate)


def _add_evaluate(sub) -> None:
    evaluate = sub.add_parser(
        "evaluate", help="perplexity (causal LM) or accuracy (image classifier) of a model dir",
        description="Without --dataset, a model a finetune run wrote is scored on the data that run evaluated on "
                    "(its options are recorded next to the model, in finetune_run.json); with --dataset, on a whole "
                    "split of that data. Data options not given are the run's, else train's defaults; the block "
                    "size is the run's, else the model's context length capped at 1024.")
    evaluate.add_argument("model_dir", help="an exported model dir or a run's final/ (with --tasks also a .gguf file)")
    defaults = TrainConfig()
    for name in EVALUATE_DATA_OPTIONS:
        checked = {"block_size": positive_int, "validation_split": fraction, "max_eval_samples": non_negative_int}
        kind = str if name == "dataset" else field_types()[name]
        kind = (lambda text: coerce(name, text)) if kind is bool else checked.get(name, kind)
        evaluate.add_argument(f"--{name}", type=kind, default=None,
                              choices=[f for f in config_fields() if f.name == name][0].metadata.get("choices"),
                              help=f"as for train (default: the run's, else {getattr(defaults, name)!r})")
    evaluate.add_argument("--dataset_split", default="",
                          help="the split to score, all of it (default: the data's validation or test split, else all "
                               "of a plain file)")
    evaluate.add_argument("--held_out", action="store_true",
                          help="score the part of the training split a run with these --validation_split and --seed "
                               "held out, instead of a whole split (default: True without --dataset for a model a "
                               "run recorded, else False)")
    evaluate.add_argument("--per_device_batch_size", type=positive_int, default=8, help="samples per batch (default: 8)")
    evaluate.add_argument("--tasks", default=None, metavar="NAMES",
                          help="comma-separated lm-evaluation-harness tasks (e.g. hellaswag,arc_easy; the shipped "
                               "offline one: finetune_stdlib_qa) instead of perplexity; scores go into the model dir "
                               "and its run's summary.json (pip install 'finetune[lm-eval]') (default: None)")
    evaluate.add_argument("--tasks_dir", default=None, metavar="DIR",
                          help="--tasks: a dir of your own lm-eval task YAML files (default: None)")
    evaluate.add_argument("--limit", type=positive_int, default=None,
                          help="--tasks: score only the first N documents of each task (default: all)")
    evaluate.add_argument("--num_fewshot", type=non_negative_int, default=None,
                          help="--tasks: examples in each prompt (default: each task's own)")
    evaluate.set_defaults(func=cmd_evaluate, subparser=evaluate)


def _add_configs(sub) -> None:
    configs = sub.add_parser("configs", help="list the accelerate configs shipped with finetune, or print one's path")
    configs.add_argument("--path", metavar="NAME", default=None,
                         help="print only the path of this config (e.g. fsdp), for accelerate launch --config_file")
    configs.set_defaults(func=cmd_configs, subparser=configs)


def _add_estimate_memory(sub) -> None:
    memory = sub.add_parser("estimate-memory", help="predict per-device memory under DDP / FSDP variants")
    memory.add_argument("--model", required=True, metavar="NAME_OR_PATH", help="preset, HF model dir or Hub id")
    memory.add_argument("--num_processes", type=positive_int, default=None, help="ranks (default: the accelerate config's, else 2)")
    memory.add_argument("--num_machines", type=positive_int, default=None,
                        help="nodes the processes are spread over: adds HSDP rows (a replica per whole number of "
                             "nodes), each layout's traffic within and across nodes, and a recommendation "
                             "(default: the accelerate config's, else 1)")
    memory.add_argument("--dp_replicate_size", type=positive_int, default=None,
                        help="plan this HSDP layout: replicas, each sharded over the rest of the ranks "
                             "(default: the accelerate config's parallelism_config_dp_replicate_size)")
    memory.add_argument("--tp_size", type=positive_int, default=None,
                        help="plan tensor parallelism over this many ranks under FSDP "
                             "(default: the accelerate config's parallelism_config_tp_size)")
    memory.add_argument("--accelerate_config", default=None, metavar="FILE",
                        help="take mixed precision and processes from this config and mark its strategy (default: None)")
    memory.add_argument("--per_device_batch_size", type=positive_int, default=8,
                        help="sequences per device (default: 8)")
    memory.add_argument("--block_size", type=positive_int, default=128, help="tokens per sequence (default: 128)")
    memory.add_argument("--images_per_sample", type=positive_int, default=1,
                        help="a vision-language model's images a row (default: 1)")
    memory.add_argument("--max_pixels", type=non_negative_int, default=0,
                        help="as for train: the most pixels an image is resized to, for the families that size images "
                             "by pixel count (Qwen-VL's)")
    memory.add_argument("--freeze_vision_tower", type=true_or_false, default=True, metavar="true|false",
                        help="as for train: the vision tower kept as loaded (default: true)")
    memory.add_argument("--loss_chunk_size", type=non_negative_int, default=TrainConfig().loss_chunk_size,
                        help="as for train: positions per chunk of the loss, 0 = the full logits "
                             f"(default: {TrainConfig().loss_chunk_size})")
    memory.add_argument("--model_dtype", choices=["float32", "bfloat16"], default="float32",
                        help="as for train: the dtype the weights are held in (default: 'float32')")
    memory.add_argument("--peft", choices=PEFT_METHODS, default="none",
                        help="lora: a frozen base (weights only) and trainable adapters; qlora: the same with the "
                             "adapted base weights in 4 bits (default: 'none')")
    memory.add_argument("--method", dest="objective", choices=OBJECTIVES, default="sft",
                        help=f"as for train: {', '.join(by_plan(lambda o: o.sequences_per_row > 1))} run each row's "
                             "sequences (a pair's two) through one forward (that many times the activations, full "
                             f"logits); {', '.join(by_plan(lambda o: ReferenceOptions in o.sections()))} add a frozen "
                             "reference without LoRA (grpo and rloo with --beta above 0), laid out as the parameters "
                             f"are; {', '.join(by_plan(lambda o: o.samples))} sample --per_device_batch_size "
                             "completions with a KV cache, then train on them through the full logits (default: 'sft')")
    memory.add_argument("--beta", type=float, default=None,
                        help="grpo, rloo: the KL coefficient; above 0 a frozen reference is held (default: the "
                             "objective's, 0 for grpo)")
    memory.add_argument("--generation_engine", choices=GENERATION_ENGINES, default="auto",
                        help="grpo, rloo: as for train: a replica adds a whole copy of the policy in the compute dtype "
                             "to each rank (auto: where the state is sharded); vllm adds "
                             "--vllm_gpu_memory_utilization of --device_memory (default: 'auto')")
    memory.add_argument("--vllm_gpu_memory_utilization", type=float, default=TrainConfig().vllm_gpu_memory_utilization,
                        help="as for train: vLLM's share of each GPU, its weights and KV cache "
                             f"(default: {TrainConfig().vllm_gpu_memory_utilization})")
    memory.add_argument("--lora_r", type=positive_int, default=TrainConfig().lora_r,
                        help=f"as for train (default: {TrainConfig().lora_r})")
    memory.add_argument("--lora_target_modules", default=TrainConfig().lora_target_modules,
                        help=f"as for train (default: {TrainConfig().lora_target_modules!r})")
    memory.add_argument("--mixed_precision", choices=["bf16", "no"], default=None,
                        help="compute dtype (default: the accelerate config's, else bf16)")
    memory.add_argument("--max_shard_size", type=byte_size, default=TrainConfig().max_shard_size,
                        help=f"as for train: the final model's largest file (default: {TrainConfig().max_shard_size})")
    memory.add_argument("--packed", action="store_true",
                        help="rows hold several examples or padding (chat, instruction or prompt-completion data; "
                             "always so for dpo and simpo pairs): sdpa and eager attention then hold a "
                             "[batch, 1, block, block] mask (default: False)")
    memory.add_argument("--attn_implementation", choices=[a for a in ATTN_IMPLEMENTATIONS if a != "auto"],
                        default="flex_attention",
                        help="as for train, on the GPU planned for: flex_attention and flash_attention_2 keep "
                             "packed rows apart without a mask (default: 'flex_attention', what auto takes on a GPU)")
    memory.add_argument("--streaming", action="store_true",
                        help="as for train: say what a streamed run's data holds in host RAM (default: False)")
    memory.add_argument("--dataloader_num_workers", type=non_negative_int, default=0,
                        help="as for train: encoding workers beside each rank of a stream (default: 0)")
    memory.add_argument("--device_memory", type=byte_size, default=None, metavar="BYTES|NGB|NGiB",
                        help="say which strategies fit in this much memory per device (default: None)")
    memory.set_defaults(func=cmd_estimate_memory, subparser=memory)


def _overrides(args: argparse.Namespace) -> dict:
    names = {f.name for f in config_fields()}
    return {k: v for k, v in vars(args).items() if k in names}


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


# Every rank meets the same bad input and rank 0 names it. A rank that exited
# first would have the launcher end rank 0 before it printed (seen under load),
# so the others wait, up to this long, for the launcher to end them once rank 0
# has exited; not when the launcher is already gone (nobody would end them).
RANK_ZERO_GRACE_S = 60


def leave_the_word_to_rank_zero(launcher_pid: int) -> None:
    """`launcher_pid`: this process's parent when the command started (read
    then, not at import: a process forked from one that imported finetune has
    another parent)."""
    import time

    deadline = time.monotonic() + RANK_ZERO_GRACE_S
    while os.getppid() == launcher_pid and time.monotonic() < deadline:
        time.sleep(0.1)


def _run(cfg: TrainConfig, default_run_dir: bool = False) -> int:
    """`default_run_dir`: cfg.output_dir is the default, named from this rank's clock."""
    from finetune.preflight import check_before_loading
    from finetune.run_dir import named_by_rank_zero

    check_before_loading(cfg)  # before the libraries load: a wrong path fails in a second, not after 10 s of imports
    if default_run_dir:
        cfg.output_dir = named_by_rank_zero(cfg.output_dir, cfg.ddp_timeout)
    keep_torchao_out_of_transformers()
    from finetune.inference import generate_text
    from finetune.report import eval_line
    from finetune.train import train

    # The libraries' objects from import (half a million) live as long as the
    # process: out of the collector's full passes (each gc.collect of a run,
    # accelerate's free_memory's among them), which walked them all (0.25 s a pass here).
    gc.freeze()
    summary = train(cfg)
    if is_rank_zero():
        print(f"run dir: {cfg.output_dir}\nfinal model: {summary['final_model_dir']}\n{eval_line(summary)}")
        held_out = summary.get("sample_prompt")  # an objective's own: a held-out prompt of the data it trained on
        if cfg.sample_prompt and held_out and cfg.sample_prompt == TrainConfig.sample_prompt:
            answer = generate_text(summary["final_model_dir"], held_out, 60, chat=None)
            shown = held_out if isinstance(held_out, str) else held_out[-1].get("content", held_out)
            print(f"fine-tuned model's answer to the held-out prompt {shown!r}: {answer!r}")
        elif cfg.sample_prompt and REGISTRY[cfg.task].generative:
            # The prompt is shown: the default ("The") is not one the user typed.
            if summary["data_format"] in ("chat", "instruction", "preference", "prompt"):  # a question to answer
                chat = True if summary["data_format"] in ("chat", "instruction") else None  # None: by the template
                answer = generate_text(summary["final_model_dir"], cfg.sample_prompt, 60, chat=chat)
                print(f"fine-tuned model's answer to {cfg.sample_prompt!r}: {answer!r}")
            else:
                sample = generate_text(summary["final_model_dir"], cfg.sample_prompt)
                print(f"fine-tuned model's sample, from the prompt {cfg.sample_prompt!r}: {sample!r}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, _overrides(args))
    if args.dry_run:
        return _dry_run(cfg.resolved(), default_run_dir=not cfg.output_dir)
    return _run(cfg.resolved(), default_run_dir=not cfg.output_dir)


def _dry_run(cfg: TrainConfig, default_run_dir: bool) -> int:
    """What `train` checks before the libraries load, and nothing after: a
    command's options, paths and launch checked in a second, on every rank."""
    from finetune.launch_request import deepspeed_requested, fsdp_requested, fsdp_version, launched_world_size
    from finetune.preflight import check_before_loading

    check_before_loading(cfg)
    if is_rank_zero():
        processes = launched_world_size()
        backend = (f"FSDP{fsdp_version()}" if fsdp_requested() else "DeepSpeed" if deepspeed_requested()
                   else "DDP" if processes > 1 else "no sharding")
        run_dir = "a new run dir under outputs/" if default_run_dir else f"run dir {cfg.output_dir}"
        data = ", ".join(cfg.sources)
        print(f"dry run: the options, --model {cfg.model}, --dataset {data}, {run_dir} and the launch "
              f"({processes} process(es), {backend}) check out; nothing was loaded, trained or written, so what "
              "only loading shows is not checked: the data's rows, the weights' shapes"
              f"{', the reward functions themselves' if cfg.reward_funcs else ''}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    import yaml

    from finetune.launch import relaunch, under_a_launcher, without_options
    from finetune.launch_record import checked_record

    run_config = Path(args.run_dir) / "run_config.yaml"
    if not run_config.is_file():
        what = "is not a run directory (no run_config.yaml)" if Path(args.run_dir).is_dir() else \
            f"{missing_or_odd(args.run_dir)}, not a run directory"
        raise UsageError(f"{args.run_dir} {what}; pass the --output_dir of a run")
    try:
        recorded = yaml.safe_load(run_config.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        recorded = None  # load_config below names the problem
    recorded = recorded if isinstance(recorded, dict) else {}
    given = _overrides(args)
    if "output_dir" in given and Path(given["output_dir"]).resolve() != Path(args.run_dir).resolve():
        raise UsageError(f"resume continues {args.run_dir} in place and takes no --output_dir; to continue in "
                         f"{given['output_dir']}, copy the run there first (cp -r {args.run_dir} "
                         f"{given['output_dir']}) and resume that")
    if "reward_funcs" in given:  # recorded with their files' absolute paths
        given["reward_funcs"] = [absolute_reward(spec) for spec in given["reward_funcs"]]
    overrides = {"resume_from_checkpoint": "latest", **given, "output_dir": args.run_dir}
    if "text_sample_by" not in recorded:  # a run from before the option: its data stays as it was made
        overrides.setdefault("text_sample_by", TEXT_SAMPLE_BY_OF_OLDER_RUNS)
    recorded_rewards = [str(spec) for spec in recorded.get("reward_funcs") or []]
    if any(is_user_code(spec) for spec in recorded_rewards) and "reward_funcs" not in given:
        raise UsageError(f"{args.run_dir} is scored by reward functions of your own code, which finetune imports "
                         "only when the command line names them: resume with "
                         f"`finetune resume {args.run_dir} --reward_funcs {' '.join(recorded_rewards)}`")
    cfg = load_config(run_config, overrides)
    if under_a_launcher():
        if args.num_processes is not None:
            raise UsageError("under a launcher, the number of processes is the launcher's: give --num_processes to "
                             "accelerate launch, before -m finetune")
        return _run(cfg)
    launch = checked_record(recorded.get("launch"), Path(args.run_dir))
    if args.no_relaunch or "launcher_options" not in launch:
        return _run(cfg)
    # Bad input fails here, before any process starts: most of it in a second, before the libraries load.
    from finetune.preflight import check_resume

    num_processes = args.num_processes or launch.get("num_processes")
    checkpoint = check_resume(cfg, num_processes)
    if checkpoint is not None:
        keep_torchao_out_of_transformers()
        from finetune.checkpoint import check_resumable

        check_resumable(cfg, checkpoint, num_processes)
    return relaunch(Path(args.run_dir), launch, without_options(args.argv, {"--num_processes"}), args.num_processes)


def cmd_export(args: argparse.Namespace) -> int:
    no_bars_off_a_terminal()
    keep_torchao_out_of_transformers()
    no_deepspeed_engine()  # it builds no DeepSpeed engine
    from finetune.cpu_threads import cpu_threads_line, use_cpu_threads
    from finetune.export import export_checkpoint, export_gguf

    threads = use_cpu_threads()
    checkpoint_options = dict(overwrite=args.overwrite, model=args.model, trust_remote_code=args.trust_remote_code,
                              allow_unverified=args.allow_unverified_checkpoint)
    if args.format == "gguf":
        for option, given in (("--dtype", args.dtype), ("--adapter_only", args.adapter_only)):
            if given:
                raise UsageError(f"{option} is for --format safetensors; a GGUF holds the merged model, "
                                 "stored as --gguf_type f16|bf16|q8_0 says")
        out = export_gguf(args.source, args.output, args.gguf_type or "f16",
                          progress=lambda line: print(line, file=sys.stderr, flush=True), **checkpoint_options)
    else:
        if args.gguf_type:
            raise UsageError("--gguf_type is for --format gguf; pass --format gguf, or --dtype for safetensors")
        out = export_checkpoint(args.source, args.output, dtype=args.dtype or "float32",
                                max_shard_size=args.max_shard_size, adapter_only=args.adapter_only,
                                **checkpoint_options)
    print(f"exported {args.source} -> {out}")
    print(cpu_threads_line(threads), file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    no_bars_off_a_terminal()
    keep_torchao_out_of_transformers()
    from finetune.cpu_threads import cpu_threads_line, use_cpu_threads
    from finetune.inference import generate_text

    if not args.prompt.strip():
        raise UsageError("--prompt is empty; give it the text to continue")
    threads = use_cpu_threads()
    print(generate_text(args.model_dir, args.prompt, args.max_new_tokens, chat=args.chat,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed, images=args.image))
    print(cpu_threads_line(threads), file=sys.stderr)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    no_bars_off_a_terminal()
    keep_torchao_out_of_transformers()
    no_deepspeed_engine()  # it builds no DeepSpeed engine
    from finetune.cpu_threads import cpu_threads_line, use_cpu_threads
    from finetune.inference import evaluate_model_dir

    threads = use_cpu_threads()
    if args.tasks:
        from finetune.benchmarks import run_benchmarks

        result = run_benchmarks(args.model_dir, args.tasks, args.tasks_dir, args.per_device_batch_size, args.limit,
                                args.num_fewshot)
        from finetune.model_card import score_line

        for task, scores in result["results"].items():
            print(f"{task}: {score_line(scores)}")
        print(json_text.dumps(result))
        print(cpu_threads_line(threads), file=sys.stderr)
        return 0
    for option in ("tasks_dir", "limit", "num_fewshot"):
        if getattr(args, option) is not None:
            raise UsageError(f"--{option} is for --tasks (lm-eval benchmarks); pass --tasks NAMES with it")
    given = {name: getattr(args, name) for name in EVALUATE_DATA_OPTIONS if getattr(args, name) is not None}
    result, notes = evaluate_model_dir(args.model_dir, given, args.dataset_split, args.held_out,
                                       args.per_device_batch_size)
    counted = f", {result['num_tokens']:,} tokens" if "num_tokens" in result else ""
    print(f"scored {result['documents']:,} documents ({result['rows']:,} rows{counted}) in {result['batches']:,} "
          f"batches; {notes}")
    print(json_text.dumps(result))
    print(cpu_threads_line(threads), file=sys.stderr)
    return 0


def cmd_configs(args: argparse.Namespace) -> int:
    from finetune.launch_configs import config_path, listing

    print(config_path(args.path) if args.path else listing())
    return 0


def by_plan(rule) -> list[str]:
    """The objectives whose class the planner's `rule` holds for."""
    return [name for name, objective in OBJECTIVE_REGISTRY.items() if rule(type(objective))]


def engine_plan(args: argparse.Namespace, shape, estimates, compute_bytes: int, num_processes: int) -> str:
    """The generation engine's paragraph of estimate-memory: what it holds and,
    for vLLM, the KV cache its share leaves once the weights are in it."""
    from finetune.memory import vllm_kv_tokens

    whole = shape.params * compute_bytes
    if args.generation_engine == "vllm":
        if not args.device_memory:
            return ("Generation engine vllm: it takes --vllm_gpu_memory_utilization of each GPU; pass --device_memory "
                    "to plan it beside training.")
        share = int(args.vllm_gpu_memory_utilization * args.device_memory)
        tokens = vllm_kv_tokens(shape, args.vllm_gpu_memory_utilization, args.device_memory, compute_bytes)
        cache = (f"after the weights ({whole / 2**30:.2f} GiB) a KV cache of about {tokens:,} tokens (at least; fewer "
                 f"KV heads hold more), {tokens // max(args.block_size, 1):,} sequences of {args.block_size}"
                 if tokens > 0 else f"which does not hold the weights ({whole / 2**30:.2f} GiB): raise "
                 "--vllm_gpu_memory_utilization")
        return (f"Generation engine vllm: {share / 2**30:.2f} GiB of each GPU ({args.vllm_gpu_memory_utilization} of "
                f"{args.device_memory / 2**30:.2f} GiB), {cache}; the generation engine column counts it and fits "
                "says whether training fits in the rest.")
    if any(e.engine for e in estimates):
        where = "every strategy" if args.generation_engine == "replica" else "the strategies that shard the state"
        return (f"Generation engine {args.generation_engine}: a whole copy of the policy, {whole / 2**30:.2f} GiB a "
                f"rank in the compute dtype, under {where} (the generation engine column); --generation_engine "
                "sharded samples from the model as held instead (slower: every token gathers every layer).")
    return (f"Generation engine {args.generation_engine}: completions are sampled from the model as each rank holds "
            "it: nothing beside training.")


def cmd_estimate_memory(args: argparse.Namespace) -> int:
    keep_torchao_out_of_transformers()
    from finetune.memory import (data_ram_line, engine_bytes, estimate, host_ram, kv_cache_bytes, model_shape, planned_meshes,
                                 read_launch_config, render, render_traffic)

    launch = read_launch_config(args.accelerate_config, args.num_processes)
    num_processes = args.num_processes or launch.num_processes
    mixed_precision = args.mixed_precision or launch.mixed_precision
    if args.peft == "none" and (args.lora_r != TrainConfig().lora_r
                                or args.lora_target_modules != TrainConfig().lora_target_modules):
        raise UsageError("--lora_r and --lora_target_modules apply to --peft lora or qlora; add it or drop them")
    from finetune.peft import peft_for

    peft = peft_for(TrainConfig(peft=args.peft, lora_r=args.lora_r, lora_target_modules=args.lora_target_modules))
    objective = OBJECTIVE_REGISTRY[args.objective]
    if not objective.samples and (args.generation_engine != "auto" or
                                  args.vllm_gpu_memory_utilization != TrainConfig().vllm_gpu_memory_utilization):
        raise UsageError(f"--generation_engine and --vllm_gpu_memory_utilization plan the sampling of "
                         f"{' and '.join(by_plan(lambda o: o.samples))}, and --method is {args.objective}; drop them "
                         "or pass --method grpo")
    if not 0 < args.vllm_gpu_memory_utilization < 1:
        raise UsageError(f"--vllm_gpu_memory_utilization must be in (0, 1), got {args.vllm_gpu_memory_utilization}; "
                         "pass e.g. 0.3")
    shape = model_shape(args.model, peft, num_processes, task=objective.tasks[0], images_per_sample=args.images_per_sample,
                        max_pixels=args.max_pixels, freeze_vision_tower=args.freeze_vision_tower)
    ram_efficient_loading = launch.ram_efficient_loading and not peft.each_rank_loads_the_base
    weight_bytes = 2 if args.model_dtype == "bfloat16" else 4
    beta = args.beta if args.beta is not None else objective.defaults.get("beta", TrainConfig.beta)
    reference_copy = objective.holds_reference(TrainConfig(objective=args.objective, beta=beta)) and \
        not peft.saves_adapters
    num_machines = args.num_machines or launch.num_machines
    meshes = planned_meshes(shape, num_processes, num_machines, args.dp_replicate_size or launch.dp_replicate,
                            args.tp_size or launch.tp)
    estimates = estimate(shape, num_processes, args.per_device_batch_size, args.block_size, mixed_precision,
                         args.loss_chunk_size, weight_bytes, ram_efficient_loading,
                         sequences_per_row=objective.sequences_per_row, samples=objective.samples,
                         reference_copy=reference_copy, meshes=meshes, packed_rows=args.packed,
                         attn_implementation=args.attn_implementation)
    if objective.samples:
        for e in estimates:
            e.engine = engine_bytes(shape, args.generation_engine, e, 2 if mixed_precision == "bf16" else 4,
                                    num_processes, args.vllm_gpu_memory_utilization, args.device_memory)
    # Where the backend keeps no shard at load, every rank loads the whole model (ZeRO-3's
    # final save, which gathers it on the main process, is not modelled).
    host = host_ram(shape, num_processes, num_processes > 1 and launch.keeps_a_shard_when_loaded,
                    ram_efficient_loading, weight_bytes, args.max_shard_size)
    print(render(shape, estimates, num_processes, args.device_memory, host))
    print("\n" + data_ram_line(args.streaming, args.dataloader_num_workers, args.block_size))
    if objective.samples:
        compute = 2 if mixed_precision == "bf16" else 4
        print("\n" + engine_plan(args, shape, estimates, compute, num_processes))
        kv = kv_cache_bytes(shape, args.per_device_batch_size, args.block_size, compute)
        print(f"\n{args.objective.upper()}: sampling {args.per_device_batch_size} completions a rank (prompt and completion within "
              f"{args.block_size} tokens) holds a KV cache of up to {kv / 2**30:.2f} GiB a rank ({kv:,} bytes; less "
              "under grouped-query attention), in place of the training activations; the activations columns hold "
              "the larger of the two.")
    if num_machines > 1 or meshes:
        sequences = args.per_device_batch_size * objective.sequences_per_row
        print("\n" + render_traffic(shape, estimates, num_processes, num_machines, mixed_precision, args.device_memory,
                                    tokens=sequences * args.block_size))
    if reference_copy:
        from finetune.backends import REGISTRY as BACKENDS

        refusing = ", ".join(b.__name__ for b in BACKENDS if b.frozen_model_refusal)
        print(f"\nNo {refusing} rows: they hold no frozen reference model (DPO with LoRA runs there).")
    if args.accelerate_config:
        print(f"\n{args.accelerate_config} runs: {launch.strategy}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from finetune.launch import leave_exit_code

    code = run_command(argv)
    leave_exit_code(code)
    return code


def entry() -> None:
    """The `finetune` command and `python -m finetune`: `main`, then an exit
    without the interpreter's teardown, which frees every object torch and
    transformers made at import one by one: 1.1 s of every process here, for
    nothing the process still needs. What a normal exit would still do is done
    first: non-daemon threads are joined and the atexit hooks run (logging's,
    trackers'); the standard streams are flushed. An exception still ends the
    usual way, with its traceback."""
    import atexit
    import threading

    code = main()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the hooks sys.exit would run (stdlib, undocumented but stable since Python 2)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, as a normal exit would find it
            pass
    os._exit(code)


def no_bars_off_a_terminal() -> None:
    """transformers' loading and GGUF bars and lm-eval's are redrawn lines: in
    a redirected log, each redraw stays. tqdm reads TQDM_DISABLE when it is
    first imported, so this comes before any library loads (`train` decides
    for its own bar: report.plain_logs)."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")


def keep_torchao_out_of_transformers() -> None:
    """transformers imports torchao with its model code whenever torchao is
    installed (the qlora extra), for checkpoints torchao quantised: 0.3 s per
    process here, and on machines without CUDA a log line for each of its CUDA
    kernels. finetune never loads such checkpoints, and a QLoRA run imports
    torchao's NF4 itself (finetune/peft/qlora.py), so transformers is told it
    is not there. Each command calls it before anything imports transformers'
    model code, and after the checks that need no library."""
    if "transformers.modeling_utils" in sys.modules:
        return
    import transformers.utils
    import transformers.utils.import_utils

    def unavailable(*args, **kwargs) -> bool:
        return False
    transformers.utils.is_torchao_available = transformers.utils.import_utils.is_torchao_available = unavailable


def run_command(argv: list[str] | None) -> int:
    launcher_pid = os.getppid()
    try:
        args = parse(argv)
        return args.func(args)
    except (UsageError, NotDistributed) as e:
        if is_rank_zero():
            print(f"error: {e}", file=sys.stderr)
        else:
            leave_the_word_to_rank_zero(launcher_pid)
        return e.exit_code
    except RankLost as e:  # every rank that noticed says so: the one that stopped answering may be rank 0
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except Stopped as e:
        if is_rank_zero():
            print(f"stopped: {e}", file=sys.stderr)
        return e.exit_code
