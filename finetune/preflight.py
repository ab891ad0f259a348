"""The checks of a training command that need no model, no data read and no
process group. Every rank runs them before transformers and datasets are
imported (about 10 CPU-s a rank on a slow CPU), so a misspelt path or a wrong
output dir ends a whole launch in about a second; those that ask for devices
import torch alone, last. The same rules run again where the
libraries load (sources.locate, models.load_config): here they only come first."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from finetune.data.locations import locate
from finetune.errors import UsageError, not_a_file
from finetune.launch_request import check_launch_runs_here
from finetune.objectives.rewards import check_reward_files
from finetune.run_dir import check_run_dir
from finetune.tasks import REGISTRY, check_preset_task, task_of_preset

if TYPE_CHECKING:
    from finetune.config import TrainConfig


def check_before_loading(cfg: TrainConfig) -> None:
    check_run_dir(cfg)
    check_preset_task(cfg.model, cfg.task)
    check_model_named(cfg.model, "--model")
    if cfg.reference_model:
        check_model_named(cfg.reference_model, "--reference_model")
    for source in cfg.sources:
        locate(source, REGISTRY[cfg.task].data_files)
    if cfg.chat_template and not Path(cfg.chat_template).is_file():
        raise UsageError(f"--chat_template {cfg.chat_template} {not_a_file(Path(cfg.chat_template))}; pass a Jinja "
                         "template file")
    check_reward_files(cfg.reward_funcs)
    check_launch_runs_here(cfg.peft, cfg.attn_implementation, cfg.use_liger_kernel)  # last: it imports torch


def check_model_named(model: str, option: str) -> None:
    """A value written as a path (./x, /x, ~/x, or with more slashes than a Hub
    id's one) must exist: otherwise the Hub would be asked for it, and fail
    slower and less clearly."""
    if task_of_preset(model) is not None or Path(model).exists():
        return
    if model.lower().endswith(".gguf"):
        raise UsageError(f"{option} {model} {not_a_file(Path(model))}; pass an existing .gguf file")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise UsageError(f"{option} {model} does not exist; pass a local HF model dir, a GGUF file, a Hub id or a "
                         f"preset ({', '.join(p for entry in REGISTRY.values() for p in entry.presets)})")
