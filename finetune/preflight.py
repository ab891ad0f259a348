"""The checks of a training command that need no model, no data read and no
process group. Every rank runs them before transformers and datasets are
imported (about 10 CPU-s a rank on a slow CPU), so a misspelt path or a wrong
output dir ends a whole launch in about a second; those that ask for devices
import torch alone, last. The same rules run again where the
libraries load (sources.locate, models.load_config): here they only come first.
`finetune resume` checks a run dir here the same way before it relaunches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from finetune.config import resume_changes
from finetune.data.fingerprint import check_same_inputs, input_fingerprints
from finetune.data.locations import glob_matches, locate
from finetune.data.stream import StreamBatches
from finetune.errors import UsageError, not_a_file
from finetune.launch_request import check_launch_runs_here
from finetune.manifest import verify_manifest
from finetune.objectives.rewards import check_reward_files
from finetune.run_dir import PROGRESS_FILE, check_run_dir, resolve_checkpoint, saved_config
from finetune.safetensors_index import missing_weight_files
from finetune.tasks import REGISTRY, check_preset_task, task_of_preset

if TYPE_CHECKING:
    from finetune.config import TrainConfig


def check_before_loading(cfg: TrainConfig) -> None:
    check_run_dir(cfg)
    check_preset_task(cfg.model, cfg.task)
    has_tokenizer = REGISTRY[cfg.task].has_tokenizer
    check_model_named(cfg.model, "--model", has_tokenizer, REGISTRY[cfg.task].presets)
    if cfg.reference_model:
        if task_of_preset(cfg.reference_model) is not None:
            raise UsageError(f"--reference_model {cfg.reference_model} is a preset, built from scratch with random "
                             "weights: no reference; pass the model dir the policy starts from, or leave it out (the "
                             "reference is then --model)")
        check_model_named(cfg.reference_model, "--reference_model", has_tokenizer)
    for source in cfg.sources:
        locate(source, REGISTRY[cfg.task].data_files)
    if cfg.chat_template and not Path(cfg.chat_template).is_file():
        raise UsageError(f"--chat_template {cfg.chat_template} {not_a_file(Path(cfg.chat_template))}; pass a Jinja "
                         "template file")
    check_reward_files(cfg.reward_funcs)
    check_router_options(cfg)
    check_launch_runs_here(cfg.peft, cfg.attn_implementation, cfg.use_liger_kernel)  # last: it imports torch


def check_resume(cfg: TrainConfig, num_processes: int | None) -> Path | None:
    """`finetune resume`'s checks that load no library, before the ones that
    do (checkpoint.check_resumable) and the relaunch: the run dir, the
    checkpoint and its manifest's checksums, the changes asked of it, the data
    it was trained on, and a stream's position on `num_processes` ranks.
    Returns the checkpoint (None: the run starts afresh)."""
    check_run_dir(cfg)
    checkpoint = resolve_checkpoint(cfg.output_dir, cfg.resume_from_checkpoint)
    if checkpoint is None:
        return None
    verify_manifest(checkpoint, allow_unverified=cfg.allow_unverified_checkpoint)
    saved = saved_config(checkpoint)
    resume_changes(saved, cfg)
    recorded = saved.get("inputs")
    if isinstance(recorded, dict):  # the frozen reference's needs the task built: check_resumable's
        check_same_inputs({name: value for name, value in recorded.items() if name != "reference"},
                          input_fingerprints(cfg), cfg, checkpoint)
    for source in cfg.sources:
        dataset = Path(source)
        if not dataset.exists() and not glob_matches(source) and (dataset.suffix or source.startswith((".", "/"))):
            raise UsageError(f"--dataset {source} does not exist from {Path.cwd()}; {checkpoint} was trained on "
                             "it: resume from the dir the run was started in, or put the data back")
    if num_processes is not None:
        try:
            progress = json.loads((checkpoint / PROGRESS_FILE).read_text())
        except (OSError, ValueError):
            return checkpoint  # damaged: check_resumable says so, reading it as training does
        if isinstance(progress, dict):
            StreamBatches.check_world_size(progress, num_processes)
    return checkpoint


def check_router_options(cfg: TrainConfig) -> None:
    """--output_router_logits on a local model dir whose config.json has no experts."""
    config_file = Path(cfg.model) / "config.json"
    if not cfg.output_router_logits or not config_file.is_file():
        return
    import json

    from finetune.models import moe
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return  # a damaged config.json is said where the model loads
    if isinstance(config, dict) and not moe.is_moe(config):
        raise UsageError(f"--output_router_logits applies to mixture-of-experts models, and --model {cfg.model} is "
                         f"dense ({config.get('model_type', 'no experts in its config.json')}); drop "
                         "--output_router_logits and --router_aux_loss_coef")


# What save_pretrained writes for a tokenizer (one of them is enough to load it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_model_named(model: str, option: str, has_tokenizer: bool = True, presets: tuple[str, ...] = ()) -> None:
    """A value written as a path (./x, /x, ~/x, or with more slashes than a Hub
    id's one) must exist: otherwise the Hub would be asked for it, and fail
    slower and less clearly. A local dir must hold what loading reads first:
    its config, its tokenizer, and every weight file its index names."""
    path = Path(model).expanduser()
    if task_of_preset(model) is not None:
        return
    presets = f" or a preset ({', '.join(presets)})" if presets else ""
    if model.lower().endswith(".gguf") and not path.is_file():
        raise UsageError(f"{option} {model} {not_a_file(path)}; pass an existing .gguf file")
    if path.is_dir():
        check_model_dir_files(path, option, has_tokenizer, presets)
        return
    if path.exists():
        if not model.lower().endswith(".gguf"):
            raise UsageError(f"{option} {model} is a file, and not a GGUF file; pass a model dir (a config.json and "
                             f"weights, as save_pretrained writes them), a .gguf file, a Hub id{presets}")
        return
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise UsageError(f"{option} {model} does not exist; pass a local HF model dir, a GGUF file, a Hub id{presets}")


def check_model_dir_files(path: Path, option: str, has_tokenizer: bool, presets: str) -> None:
    if not (path / "config.json").is_file():
        raise UsageError(f"{option} {path} is not a model directory (no config.json); pass a dir written by "
                         f"save_pretrained, a GGUF file, a Hub id{presets}")
    if has_tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"{option} {path} has no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...); save the "
                         "model's tokenizer into it with save_pretrained")
    missing_weight_files(path, f"{option} {path}")
