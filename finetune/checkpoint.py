"""Sharded checkpoints: when to save, how to save atomically, what to keep,
how to find one, check it, and load it (also on another number of ranks).

Each checkpoint is `accelerator.save_state` output (model and optimizer as DCP
shards under FSDP, scheduler, per-rank RNG states) plus
`training_progress.json` and the run config. It is written under a temporary
name and renamed only after every rank has finished writing, so a directory
named `step_NNNNNN` is always complete.

Across a change of world size, DCP reshards the model and the optimizer
moments, and the step, LR schedule and epoch carry over exactly. The
data position carries over to within one global batch (the epoch's sample
order is the same, the cut between ranks is not). Ranks that did not exist
when the checkpoint was written get a fresh RNG stream seeded from
(seed, step, rank).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from finetune.distributed import canonical_name, rank_warning
from finetune.errors import UsageError
from finetune.model_dir import write_model_files


PROGRESS_FILE = "training_progress.json"
MODEL_SHARDS_DIR = "pytorch_model_fsdp_0"
OPTIMIZER_SHARDS_DIR = "optimizer_0"
MODEL_CONFIG_DIR = "model_config"
PREFIX = "step_"


@dataclass
class TrainingProgress:
    step: int = 0                      # optimizer steps done
    epoch: int = 0                     # current epoch (0-based)
    samples_in_epoch: int = 0          # samples all ranks together consumed in the current epoch
    epoch_loss_sum: float = 0.0        # sum of the step losses of the current epoch so far
    epoch_steps: int = 0               # steps of the current epoch so far
    world_size: int = 1                # ranks that wrote the checkpoint


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def checkpoint_step(checkpoint_dir: Path) -> int:
    return int(checkpoint_dir.name[len(PREFIX):])


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp dirs are never listed)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=checkpoint_step)


def resolve_checkpoint(run_dir: str | Path, spec: str) -> Path:
    """Turn `latest` or a path into a checkpoint dir, with clear errors."""
    if spec == "latest":
        found = complete_checkpoints(run_dir)
        if not found:
            raise UsageError(f"no complete checkpoint under {Path(run_dir) / 'checkpoints'} to resume from; "
                             "drop --resume_from_checkpoint to start fresh")
        return found[-1]
    path = Path(spec)
    if not (path / PROGRESS_FILE).is_file():
        raise UsageError(f"{spec} is not a checkpoint of this tool (no {PROGRESS_FILE}); "
                         "pass a checkpoints/step_NNNNNN dir or 'latest'")
    return path


def read_progress(checkpoint_dir: Path) -> TrainingProgress:
    saved = json.loads((checkpoint_dir / PROGRESS_FILE).read_text())
    known = {f.name for f in fields(TrainingProgress)}  # older checkpoints hold fields since dropped
    return TrainingProgress(**{k: v for k, v in saved.items() if k in known})


def check_dcp_files(shard_dir: Path) -> FileSystemReader:
    """Every file the DCP metadata names exists and is long enough."""
    try:
        reader = FileSystemReader(str(shard_dir))
        metadata = reader.read_metadata()
    except Exception:
        raise UsageError(f"{shard_dir} has no readable DCP metadata (.metadata); the checkpoint is incomplete, "
                         "resume from an earlier one") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = shard_dir / name
        if not path.is_file():
            raise UsageError(f"shard {path} is missing; the checkpoint is incomplete, resume from an earlier one")
        if path.stat().st_size < size:
            raise UsageError(f"shard {path} is truncated ({path.stat().st_size} of {size} bytes); "
                             "the checkpoint is damaged, resume from an earlier one")
    return reader


def saved_shapes(checkpoint_dir: Path) -> dict[str, tuple[int, ...]]:
    """Parameter shapes stored in a checkpoint, without loading any tensor."""
    shard_dir = checkpoint_dir / MODEL_SHARDS_DIR
    if shard_dir.is_dir():
        metadata = check_dcp_files(shard_dir).read_metadata()
        return {fqn.removeprefix("model."): tuple(meta.size) for fqn, meta in metadata.state_dict_metadata.items()
                if hasattr(meta, "size")}
    weights = checkpoint_dir / "model.safetensors"
    if weights.is_file():
        with safe_open(str(weights), "pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    raise UsageError(f"{checkpoint_dir} holds no model weights ({MODEL_SHARDS_DIR}/ or model.safetensors); "
                     "resume from another checkpoint")


def check_compatible(checkpoint_dir: Path, model: torch.nn.Module, sharded_run: bool) -> None:
    """The checkpoint was written for this architecture and size, and in the
    layout this run reads (FSDP shards, or one file)."""
    stored = saved_shapes(checkpoint_dir)
    for live_name, param in model.named_parameters():
        name = canonical_name(live_name)
        if name not in stored:
            raise UsageError(f"checkpoint {checkpoint_dir} has no parameter {name}: it was written for another "
                             "architecture; resume with the run's own --model")
        if tuple(param.shape) != stored[name]:
            raise UsageError(f"checkpoint {checkpoint_dir} does not fit the model: {name} is {list(stored[name])} "
                             f"in the checkpoint and {list(param.shape)} in the model; resume with the run's own --model")
    if (checkpoint_dir / MODEL_SHARDS_DIR).is_dir() and not sharded_run:
        raise UsageError(f"{checkpoint_dir} holds FSDP shards and this run is not FSDP; resume it under "
                         "`accelerate launch --config_file accelerate_configs/fsdp.yaml` (any --num_processes)")
    if not (checkpoint_dir / MODEL_SHARDS_DIR).is_dir() and sharded_run:
        raise UsageError(f"{checkpoint_dir} was written without FSDP and this run is FSDP; resume it with the "
                         "accelerate config it was trained with, or start from its export with --model")
    if (checkpoint_dir / OPTIMIZER_SHARDS_DIR).is_dir():
        check_dcp_files(checkpoint_dir / OPTIMIZER_SHARDS_DIR)


class CheckpointManager:
    """Saves every `every` steps, after every `every_epochs` epochs, and at the
    end; keeps the newest `keep_last`. Each checkpoint also holds the run config
    and, under `model_config/`, what an offline export needs besides the
    weights (HF config, generation config, tokenizer)."""

    def __init__(self, accelerator: Accelerator, run_dir: str | Path, *, every: int, every_epochs: int,
                 keep_last: int, config_yaml: str, hf_config: PretrainedConfig,
                 tokenizer: PreTrainedTokenizerBase | None):
        self.accelerator = accelerator
        self.root = Path(run_dir) / "checkpoints"
        self.every = every
        self.every_epochs = every_epochs
        self.keep_last = keep_last
        self.config_yaml = config_yaml
        self.hf_config = hf_config
        self.tokenizer = tokenizer

    def maybe_save(self, progress: TrainingProgress, *, epoch_end: bool = False, final: bool = False) -> Path | None:
        """Call after every optimizer step, after every epoch (epoch_end, with
        progress.epoch already counting the finished epoch) and at the end."""
        due = (final or (self.every > 0 and progress.step % self.every == 0)
               or (epoch_end and self.every_epochs > 0 and progress.epoch % self.every_epochs == 0))
        if not due or (self.root / checkpoint_name(progress.step)).exists():
            return None
        return self.save(progress)

    def save(self, progress: TrainingProgress) -> Path:
        acc = self.accelerator
        start = time.perf_counter()
        target = self.root / checkpoint_name(progress.step)
        tmp = self.root / f".tmp-{target.name}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that died
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        if acc.is_main_process:
            progress.world_size = acc.num_processes
            (tmp / PROGRESS_FILE).write_text(json.dumps(asdict(progress), indent=2))
            (tmp / "run_config.yaml").write_text(self.config_yaml)
            write_model_files(tmp / MODEL_CONFIG_DIR, self.hf_config, self.tokenizer)
        acc.wait_for_everyone()  # every rank's shards are on disk
        if acc.is_main_process:
            os.replace(tmp, target)
            self._prune()
        acc.wait_for_everyone()
        acc.print(f"saved checkpoint {target} in {time.perf_counter() - start:.2f} s")
        return target

    def _prune(self) -> None:
        """Drop all but the newest keep_last complete checkpoints (never the newest)."""
        if self.keep_last <= 0:
            return
        for old in complete_checkpoints(self.root.parent)[:-self.keep_last]:
            shutil.rmtree(old)

    def load(self, checkpoint_dir: Path, model: torch.nn.Module, seed: int) -> TrainingProgress:
        acc = self.accelerator
        check_compatible(checkpoint_dir, acc.unwrap_model(model), acc.distributed_type == DistributedType.FSDP)
        progress = read_progress(checkpoint_dir)
        start = time.perf_counter()
        acc.load_state(str(checkpoint_dir))
        acc.print(f"loaded checkpoint {checkpoint_dir} in {time.perf_counter() - start:.2f} s")
        if progress.world_size != acc.num_processes:
            acc.print(f"checkpoint written by {progress.world_size} rank(s), resuming on {acc.num_processes}: "
                      "model and optimizer resharded; step, LR schedule and epoch carry over; the data position "
                      "carries over to within one global batch")
        if acc.process_index >= progress.world_size:
            # No saved RNG stream for this rank: a fresh one, the same on every resume.
            set_seed(seed + 1_000_003 * progress.step + acc.process_index)
            rank_warning(acc, f"no RNG state for this rank in {checkpoint_dir}; seeded from (seed, step, rank)")
        progress.world_size = acc.num_processes
        return progress
