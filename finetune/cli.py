"""Command line: parse -> config -> dispatch.

    finetune train [OPTIONS]            (under accelerate launch, torchrun, or alone)
    finetune resume RUN_DIR [OPTIONS]   continue a run from its latest checkpoint
    finetune export CHECKPOINT_OR_RUN_DIR --output DIR [--dtype float32|bfloat16]
    finetune generate MODEL_DIR --prompt TEXT
    finetune evaluate MODEL_DIR --dataset ID_OR_PATH

Bad input raises `UsageError`: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

from finetune.config import TrainConfig, config_fields, field_types, load_config
from finetune.errors import UsageError


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.yaml", help="run config file; command-line options override it")
    defaults = TrainConfig()
    types = field_types()
    for f in config_fields():
        default = getattr(defaults, f.name)
        help_text = f"{f.metadata['help']} (default: {default!r})".replace("%", "%%")
        kwargs = dict(default=argparse.SUPPRESS, help=help_text, choices=f.metadata.get("choices"))
        if types[f.name] is bool:
            parser.add_argument(f"--{f.name}", nargs="?", const=True, metavar="true|false", **kwargs)
        else:
            parser.add_argument(f"--{f.name}", metavar=types[f.name].__name__.upper(), **kwargs)


class _Parser(argparse.ArgumentParser):
    """argparse, but bad options are UsageErrors (one line, exit 2), and no
    silent prefix matching (--max_step is a typo, not --max_steps)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            unknown = next((a for a in message.split()[2:] if a.startswith("--")), "")
            options = [f"--{f.name}" for f in config_fields()] + ["--config"]
            close = difflib.get_close_matches(unknown.split("=")[0], options, n=1)
            if close:
                message = f"unknown option {unknown}; did you mean {close[0]}?"
        raise UsageError(f"{message}; see `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="finetune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="fine-tune a model (launch with accelerate launch for FSDP)")
    _add_config_options(train)
    train.set_defaults(func=cmd_train)

    resume = sub.add_parser("resume", help="continue a run from its latest checkpoint, with optional overrides")
    resume.add_argument("run_dir", help="a run directory holding run_config.yaml and checkpoints/")
    _add_config_options(resume)
    resume.set_defaults(func=cmd_resume)

    export = sub.add_parser("export", help="merge a sharded checkpoint into a HF model dir (one process, CPU)")
    export.add_argument("source", metavar="CHECKPOINT_OR_RUN_DIR",
                        help="a checkpoints/step_NNNNNN dir, or a run dir (its newest complete checkpoint)")
    export.add_argument("--output", required=True, metavar="DIR", help="the model dir to write")
    export.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of the stored weights (default: 'float32')")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty --output (default: False)")
    export.add_argument("--max_shard_size", default="2GB",
                        help="split the weights into files of at most this size (default: '2GB')")
    export.add_argument("--model", default=None, metavar="NAME_OR_PATH",
                        help="HF model dir or id for config and tokenizer, for checkpoints not written by finetune "
                             "(default: the checkpoint's own model_config/)")
    export.set_defaults(func=cmd_export)

    generate = sub.add_parser("generate", help="generate text from a model dir")
    generate.add_argument("model_dir", help="an exported model dir or a run's final/")
    generate.add_argument("--prompt", required=True, help="text to continue")
    generate.add_argument("--max_new_tokens", type=int, default=40, help="tokens to generate (default: 40)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    generate.set_defaults(func=cmd_generate)

    evaluate = sub.add_parser("evaluate", help="perplexity of a model dir on a dataset")
    evaluate.add_argument("model_dir", help="an exported model dir or a run's final/")
    defaults = TrainConfig()
    for name in ("dataset", "text_column", "block_size", "validation_split", "seed"):
        evaluate.add_argument(f"--{name}", type=field_types()[name], default=getattr(defaults, name),
                              help=f"as for train (default: {getattr(defaults, name)!r})")
    evaluate.add_argument("--split", choices=["validation", "train"], default="validation",
                          help="which split to score (default: 'validation')")
    evaluate.add_argument("--per_device_batch_size", type=int, default=8, help="sequences per batch (default: 8)")
    evaluate.set_defaults(func=cmd_evaluate)
    return parser


def _overrides(args: argparse.Namespace) -> dict:
    names = {f.name for f in config_fields()}
    return {k: v for k, v in vars(args).items() if k in names}


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _run(cfg: TrainConfig) -> int:
    from finetune.inference import generate_text
    from finetune.train import train

    summary = train(cfg)
    if is_rank_zero():
        print(f"run dir: {cfg.output_dir}\nfinal model: {summary['final_model_dir']}")
        first, last = summary["first_eval"], summary["last_eval"]
        if first:
            print(f"validation perplexity: {first['perplexity']:.2f} -> {last['perplexity']:.2f}")
        if cfg.sample_prompt:
            print(f"sample: {generate_text(summary['final_model_dir'], cfg.sample_prompt)!r}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    return _run(load_config(args.config, _overrides(args)).resolved())


def cmd_resume(args: argparse.Namespace) -> int:
    run_config = Path(args.run_dir) / "run_config.yaml"
    if not run_config.is_file():
        raise UsageError(f"{args.run_dir} is not a run directory (no run_config.yaml); pass the --output_dir of a run")
    if args.config:
        raise UsageError("resume takes its config from RUN_DIR/run_config.yaml; pass changes as options, not --config")
    overrides = {**_overrides(args), "output_dir": args.run_dir, "resume_from_checkpoint": "latest"}
    return _run(load_config(run_config, overrides))


def cmd_export(args: argparse.Namespace) -> int:
    from finetune.export import export_checkpoint

    out = export_checkpoint(args.source, args.output, dtype=args.dtype, overwrite=args.overwrite, model=args.model,
                            max_shard_size=args.max_shard_size)
    print(f"exported {args.source} -> {out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from finetune.inference import generate_text

    print(generate_text(args.model_dir, args.prompt, args.max_new_tokens, args.seed))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from finetune.inference import evaluate_model_dir

    result = evaluate_model_dir(args.model_dir, args.dataset, args.text_column, args.split, args.block_size,
                                args.per_device_batch_size, args.validation_split, args.seed)
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        if is_rank_zero():
            print(f"error: {e}", file=sys.stderr)
        return 2
