"""Sharded checkpoints: when to save, how to save atomically, what to keep,
and how to find and load one.

Each checkpoint is `accelerator.save_state` output (model and optimizer as DCP
shards, scheduler, per-rank RNG states) plus `training_progress.json` and the
run config. It is written under a temporary name and renamed only after every
rank has finished writing, so a directory named `step_NNNNNN` is always
complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate import Accelerator

from finetune.errors import UsageError

PROGRESS_FILE = "training_progress.json"
MODEL_SHARDS_DIR = "pytorch_model_fsdp_0"
PREFIX = "step_"


@dataclass
class TrainingProgress:
    step: int = 0                      # optimizer steps done
    epoch: int = 0                     # current epoch (0-based)
    batches_in_epoch: int = 0          # micro-batches each rank consumed in the current epoch
    samples_in_epoch: int = 0          # samples all ranks consumed in the current epoch
    best_eval_loss: float = math.inf
    world_size: int = 1


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp dirs are never listed)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def resolve_checkpoint(run_dir: str | Path, spec: str) -> Path:
    """Turn `latest` or a path into a checkpoint dir, with clear errors."""
    if spec == "latest":
        found = complete_checkpoints(run_dir)
        if not found:
            raise UsageError(f"no complete checkpoint under {Path(run_dir) / 'checkpoints'} to resume from; "
                             "drop --resume_from_checkpoint to start fresh")
        return found[-1]
    path = Path(spec)
    if not (path / PROGRESS_FILE).is_file() or not (path / MODEL_SHARDS_DIR).is_dir():
        raise UsageError(f"{spec} is not a complete checkpoint (no {PROGRESS_FILE} or {MODEL_SHARDS_DIR}/); "
                         "pass a checkpoints/step_NNNNNN dir or 'latest'")
    return path


def read_progress(checkpoint_dir: Path) -> TrainingProgress:
    return TrainingProgress(**json.loads((checkpoint_dir / PROGRESS_FILE).read_text()))


class CheckpointManager:
    def __init__(self, accelerator: Accelerator, run_dir: str | Path, every: int, keep_last: int):
        self.accelerator = accelerator
        self.root = Path(run_dir) / "checkpoints"
        self.every = every
        self.keep_last = keep_last

    def maybe_save(self, progress: TrainingProgress, config_yaml: str, final: bool = False) -> Path | None:
        due = final or (self.every > 0 and progress.step % self.every == 0)
        target = self.root / checkpoint_name(progress.step)
        if not due or target.exists():
            return None
        return self.save(progress, config_yaml)

    def save(self, progress: TrainingProgress, config_yaml: str) -> Path:
        acc = self.accelerator
        target = self.root / checkpoint_name(progress.step)
        tmp = self.root / f".tmp-{target.name}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that died
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        if acc.is_main_process:
            (tmp / PROGRESS_FILE).write_text(json.dumps(asdict(progress), indent=2))
            (tmp / "run_config.yaml").write_text(config_yaml)
        acc.wait_for_everyone()  # every rank's shards are on disk
        if acc.is_main_process:
            os.replace(tmp, target)
            self._prune()
        acc.wait_for_everyone()
        return target

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for old in complete_checkpoints(self.root.parent)[:-self.keep_last]:
            shutil.rmtree(old)

    def load(self, checkpoint_dir: Path) -> TrainingProgress:
        self.accelerator.load_state(str(checkpoint_dir))
        return read_progress(checkpoint_dir)
