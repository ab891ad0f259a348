"""Command line: parse -> config -> dispatch.

    finetune train [OPTIONS]            (under accelerate launch, torchrun, or alone)
    finetune resume RUN_DIR [OPTIONS]   continue a run from its latest checkpoint

Bad input raises `UsageError`: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
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
    return parser


def _overrides(args: argparse.Namespace) -> dict:
    names = {f.name for f in config_fields()}
    return {k: v for k, v in vars(args).items() if k in names}


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _run(cfg: TrainConfig) -> int:
    from finetune.generate import generate_text
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


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        if is_rank_zero():
            print(f"error: {e}", file=sys.stderr)
        return 2
