"""Sharded checkpoints: when to save, how to save atomically, what to keep,
how to find one, check it, and load it (also on another number of ranks).

Each checkpoint is `accelerator.save_state` output (model and optimizer in
the layout of the run's backend, finetune/backends: DCP shards under FSDP;
scheduler, per-rank RNG states) plus `training_progress.json` and the run
config. It is written under a temporary
name and renamed only after every rank has finished writing, so a directory
named `step_NNNNNN` is always complete.

Across a change of world size, DCP reshards the model and the optimizer
moments, and the step, LR schedule and epoch carry over exactly. The
data position carries over to within one global batch (the epoch's sample
order is the same, the cut between ranks is not), where the backend can
reshard (`check_resume_world_size`). Ranks that did not exist
when the checkpoint was written get a fresh RNG stream seeded from
(seed, step, rank).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Protocol

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import PreTrainedTokenizerBase

from finetune.backends import for_checkpoint
from finetune.backends.base import Backend
from finetune.collectives import WriteFailed, on_every_rank
from finetune.config import TrainConfig
from finetune.data.fingerprint import check_same_inputs, reference_fingerprint
from finetune.data.stream import DataState, EpochBatches
from finetune.errors import UsageError, write_failure_fix
from finetune.model_dir import MODEL_CONFIG_DIR, tied_duplicates, write_model_files
from finetune.parameters import canonical_name
from finetune.report import rank_warning, say
from finetune.run_dir import (CHECKPOINT_PREFIX, PROGRESS_FILE, checkpoint_step,
                              complete_checkpoints, saved_config)
from finetune.manifest import MANIFEST, verify_manifest, write_manifest
from finetune.verify import check_pickled_file
from finetune import json_text

class ModelFilesPolicy(Protocol):
    """What the PEFT method adds to a checkpoint's model_config/ and checks on resume."""

    def write_checkpoint_files(self, model_files: Path, model: torch.nn.Module, tied: dict[str, str]) -> None: ...

    def check_checkpoint(self, model_files: Path, checkpoint_dir: Path) -> None: ...


PREFIX = CHECKPOINT_PREFIX
FULL_DISK_BYTES = 64 * 2**20  # a failed save with less free space than this ran out of it


@dataclass
class TrainingProgress:
    step: int = 0                      # optimizer steps done
    epoch: int = 0                     # current epoch (0-based)
    epoch_loss_sum: float = 0.0        # sum of the step losses of the current epoch so far
    epoch_steps: int = 0               # steps of the current epoch so far
    world_size: int = 1                # ranks that wrote the checkpoint


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def read_progress(checkpoint_dir: Path) -> TrainingProgress:
    path = checkpoint_dir / PROGRESS_FILE
    known = {f.name: f.type for f in fields(TrainingProgress)}
    try:
        saved = json.loads(path.read_text())
        # Older checkpoints hold fields since dropped; every field kept is a number.
        values = {k: v for k, v in saved.items() if k in known}
        if "step" not in values or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                           for v in values.values()):
            raise ValueError
        EpochBatches.checked_position(saved, str(path))  # the data's position, kept in the same file
        return TrainingProgress(**{k: int(v) if known[k] == "int" else float(v) for k, v in values.items()})
    except (OSError, ValueError, AttributeError):
        raise UsageError(f"{path} is missing or not this tool's training progress; the checkpoint is damaged, "
                         "resume from an earlier one") from None


def verify_checkpoint(checkpoint_dir: Path, allow_unverified: bool = False) -> TrainingProgress:
    """Everything a resume reads, checked before anything is loaded: the
    manifest's checksums, the progress, the model and optimizer in the layout
    of the backend that wrote them (DCP shards: their metadata and non-tensor
    items read safely), the scheduler and RNG files. Without a manifest only
    when `allow_unverified` (the command line's --allow_unverified_checkpoint)."""
    verify_manifest(checkpoint_dir, allow_unverified=allow_unverified)
    return check_checkpoint_files(checkpoint_dir)


def check_checkpoint_files(checkpoint_dir: Path) -> TrainingProgress:
    """verify_checkpoint less the manifest: what needs the libraries."""
    progress = read_progress(checkpoint_dir)
    for_checkpoint(checkpoint_dir).check_checkpoint_files(checkpoint_dir)
    check_pickled_file(checkpoint_dir / "scheduler.bin")
    for rank in range(progress.world_size):
        check_pickled_file(checkpoint_dir / f"random_states_{rank}.pkl")
    return progress


def check_compatible(checkpoint_dir: Path, model: torch.nn.Module, backend: Backend) -> None:
    """The checkpoint was written for this architecture and size, and in the
    layout this run's backend reads."""
    written = for_checkpoint(checkpoint_dir)
    stored = written.saved_shapes(checkpoint_dir)
    for live_name, param in model.named_parameters():
        name = canonical_name(live_name)
        if name not in stored and not param.requires_grad:
            continue  # a frozen base parameter: read from --model, not from checkpoints
        if name not in stored:
            raise UsageError(f"checkpoint {checkpoint_dir} has no parameter {name}: it was written for another "
                             "architecture; resume with the run's own --model")
        shape = tuple(getattr(param, "ds_shape", param.shape))  # a ZeRO-3 parameter's own tensor is empty
        if shape != stored[name]:
            raise UsageError(f"checkpoint {checkpoint_dir} does not fit the model: {name} is {list(stored[name])} "
                             f"in the checkpoint and {list(shape)} in the model; resume with the run's own --model")
    if written.layout == backend.layout:
        return
    raise UsageError(f"{checkpoint_dir} was written {written.written_as} and this run is {backend.run_is}; resume it "
                     f"with `finetune resume {checkpoint_dir.parent.parent}` (relaunched as it was launched) or under "
                     f"the accelerate config it was trained with (e.g. `--config_file $(finetune configs --path "
                     f"{written.example_config})`), or export it and start from the export with --model")


def check_resumable(cfg: TrainConfig, checkpoint: Path, num_processes: int | None = None) -> None:
    """What a resume checks with the libraries loaded, before any process
    starts (on `num_processes` ranks), after preflight.check_resume: the
    checkpoint's files read safely, the frozen reference, whether its layout
    resumes on that many ranks, and the base under its adapters."""
    from finetune.objectives import build_task

    progress = check_checkpoint_files(checkpoint)
    task = build_task(cfg)
    recorded = saved_config(checkpoint).get("inputs")
    if isinstance(recorded, dict) and (reference := task.frozen_reference()):
        check_same_inputs({"reference": recorded.get("reference")}, {"reference": reference_fingerprint(reference)},
                          cfg, checkpoint)
    if num_processes is not None:
        for_checkpoint(checkpoint).check_resume_world_size(checkpoint, progress.world_size, num_processes)
    task.peft.check_base_before_launch(task, checkpoint / MODEL_CONFIG_DIR, checkpoint)


class StoredState:
    """What a checkpoint leaves out of the model's state dict, and how a load
    puts it back, while `active` (a save or a load of this manager):
    - a tied parameter (an output layer sharing the input embedding) is in the
      state dict under each of its names, and DCP would write every one (+21%
      of SmolLM2-135M's checkpoint): kept under its first name only, and
      loaded once under it, which restores the tie;
    - frozen parameters (the base under adapters) never change: they come from
      --model, so a load keeps the live ones.
    Everything else (the end-of-run gather, exports) sees the whole state."""

    def __init__(self, model: torch.nn.Module, leave_out: bool = True):
        """`leave_out`: False where the backend needs the whole state dict (FSDP1)."""
        self.active = False
        self.leave_out = leave_out
        self.duplicates = tied_duplicates(model)
        self.frozen = {canonical_name(name) for name, p in model.named_parameters() if not p.requires_grad}
        self.live = model
        # torch marks its hooks with an attribute, which bound methods cannot take: wrap them.
        model.register_state_dict_post_hook(lambda *args: self._leave_out(*args))
        model.register_load_state_dict_pre_hook(lambda *args: self._put_back(*args))

    @contextmanager
    def applied(self):
        """Around the manager's own saves and loads."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def _leave_out(self, module, state_dict, prefix, local_metadata):
        if not (self.active and self.leave_out):
            return
        for name in [*self.duplicates, *self.frozen]:
            state_dict.pop(prefix + name, None)

    def _put_back(self, module, state_dict, prefix, *args):
        if not self.active:
            return
        if self.frozen:
            live = {canonical_name(n): p for n, p in self.live.named_parameters()}
            for name in self.frozen:
                state_dict.setdefault(prefix + name, live[name])
        for name, first in self.duplicates.items():
            if prefix + first in state_dict:
                state_dict.setdefault(prefix + name, state_dict[prefix + first])


class CheckpointManager:
    """Saves every `every` steps, after every `every_epochs` epochs, and at the
    end; keeps the newest `keep_last`. Each checkpoint also holds the run config
    and, under `model_config/`, what an offline export needs besides the
    weights (HF config, generation config, tokenizer)."""

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, run_dir: str | Path, *, every: int,
                 every_epochs: int, keep_last: int, at_end: bool = True, config_yaml: str,
                 tokenizer: PreTrainedTokenizerBase | None, peft: ModelFilesPolicy, data: list[DataState],
                 backend: Backend | None = None, allow_unverified: bool = False):
        self.accelerator = accelerator
        self.allow_unverified = allow_unverified  # --allow_unverified_checkpoint: a resume may read one without a manifest
        self.backend = backend or Backend()  # the layout this run writes and reads
        self.peft = peft  # the PEFT method: what it adds to model_config/, and checks on resume
        self.data = data      # the training batches' position and what they consumed: saved with every checkpoint
        self.unwrapped = unwrapped = accelerator.unwrap_model(model)
        self.stored = StoredState(unwrapped, leave_out=self.backend.checkpoints_leave_out_stored_state)
        self.root = Path(run_dir) / "checkpoints"
        self.every = every
        self.every_epochs = every_epochs
        self.keep_last = keep_last
        self.at_end = at_end
        self.config_yaml = config_yaml
        self.hf_config = unwrapped.config
        self.tokenizer = tokenizer
        self.last_saved_step: int | None = None  # the state of this step is on disk already

    def start_timeline(self, step: int, resumed_from: Path | None) -> None:
        """Call once the run may write. Checkpoints after `step` belong to a
        timeline this run abandons (a resume from an older checkpoint, or a
        fresh run with --overwrite): they are moved aside, never deleted, and
        never mistaken for this run's."""
        if resumed_from is not None and resumed_from.resolve().parent == self.root.resolve():
            self.last_saved_step = step  # the checkpoint resumed from is this run's own
        acc = self.accelerator
        if acc.is_main_process:
            # Saves that died half-way: this run holds the run dir's lock, so nobody is writing them.
            for leftover in self.root.glob(".tmp-*"):
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover)
            later = [c for c in complete_checkpoints(self.root.parent) if checkpoint_step(c) > step]
            if later:
                aside = self._set_aside(later)
                say(acc, f"moved {len(later)} checkpoint(s) of the abandoned timeline ({later[0].name}..."
                          f"{later[-1].name}) aside to {aside}")
        acc.wait_for_everyone()

    def _set_aside(self, checkpoints: list[Path]) -> Path:
        aside = self.root / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        aside.mkdir(parents=True, exist_ok=True)
        for checkpoint in checkpoints:
            os.replace(checkpoint, aside / checkpoint.name)
        return aside

    def maybe_save(self, progress: TrainingProgress, *, epoch_end: bool = False, end: bool = False,
                   stop: bool = False) -> Path | None:
        """Call after every optimizer step, after every epoch (epoch_end, with
        progress.epoch already counting the finished epoch), at the end, and
        when a stop was requested (always saved: the run is to be continued)."""
        due = (stop or (end and self.at_end) or (self.every > 0 and progress.step % self.every == 0)
               or (epoch_end and self.every_epochs > 0 and progress.epoch % self.every_epochs == 0))
        if not due or progress.step == self.last_saved_step:
            return None
        return self.save(progress)

    def save(self, progress: TrainingProgress) -> Path:
        """Written under a temporary name and renamed when every rank is done.
        A write that fails on any rank (a full disk, a read-only dir) fails on
        all of them alike: the temporary dir goes, earlier checkpoints stay."""
        acc = self.accelerator
        start = time.perf_counter()
        target = self.root / checkpoint_name(progress.step)
        tmp = self.root / f".tmp-{target.name}"
        try:
            data_state = {key: value for part in self.data for key, value in part.state_dict().items()}  # a collective
            on_every_rank(acc, lambda: self._make_dir(tmp))
            with self.stored.applied():
                on_every_rank(acc, lambda: acc.save_state(str(tmp)))
            on_every_rank(acc, lambda: self._complete(tmp, target, progress, data_state))
        except WriteFailed as e:
            # torch.save's own words for a full disk are cryptic: look at the disk before freeing the temporary dir.
            free = shutil.disk_usage(self.root).free
            full = free < FULL_DISK_BYTES
            reason = f"no space left on the device, {free:,} bytes free" if full else str(e)
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            newest = complete_checkpoints(self.root.parent)
            kept = f"{newest[-1]} is intact" if newest else "no earlier checkpoint exists"
            raise UsageError(f"could not write checkpoint {target} ({reason}); {kept}: "
                             f"{write_failure_fix(reason, self.root, full)}, then continue with "
                             f"`finetune resume {self.root.parent}`") from None
        self.last_saved_step = progress.step
        say(acc, f"saved checkpoint {target} in {time.perf_counter() - start:.2f} s")
        return target

    def _make_dir(self, tmp: Path) -> None:
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that died
            tmp.mkdir(parents=True)

    def _complete(self, tmp: Path, target: Path, progress: TrainingProgress, data_state: dict) -> None:
        """After every rank's shards are on disk: the main process adds the
        progress, the configs and, last, the manifest, then renames."""
        if not self.accelerator.is_main_process:
            return
        progress.world_size = self.accelerator.num_processes
        (tmp / PROGRESS_FILE).write_text(json_text.dumps({**asdict(progress), **data_state}, indent=2))
        (tmp / "run_config.yaml").write_text(self.config_yaml)
        write_model_files(tmp / MODEL_CONFIG_DIR, self.hf_config, self.tokenizer)
        tied = {canonical_name(name): canonical_name(first) for name, first in self.stored.duplicates.items()}
        self.peft.write_checkpoint_files(tmp / MODEL_CONFIG_DIR, self.unwrapped, tied)
        write_manifest(tmp)  # last: a checkpoint with a manifest is complete
        if target.exists():  # not this run's (start_timeline moved its predecessors aside)
            self._set_aside([target])
        os.replace(tmp, target)
        self._prune()

    def _prune(self) -> None:
        """Drop all but the newest keep_last complete checkpoints (never the newest)."""
        if self.keep_last <= 0:
            return
        for old in complete_checkpoints(self.root.parent)[:-self.keep_last]:
            shutil.rmtree(old)

    def load(self, checkpoint_dir: Path, model: torch.nn.Module, seed: int) -> TrainingProgress:
        acc = self.accelerator
        start = time.perf_counter()
        progress = verify_checkpoint(checkpoint_dir, self.allow_unverified)
        if (checkpoint_dir / MANIFEST).is_file():
            say(acc, f"verified {checkpoint_dir} against its manifest in {time.perf_counter() - start:.2f} s")
        else:
            say(acc, f"note: {checkpoint_dir} has no {MANIFEST}: its files were not checked for damage "
                      "(--allow_unverified_checkpoint)")
        check_compatible(checkpoint_dir, acc.unwrap_model(model), self.backend)
        self.backend.check_resume_world_size(checkpoint_dir, progress.world_size, acc.num_processes)
        self.peft.check_checkpoint(checkpoint_dir / MODEL_CONFIG_DIR, checkpoint_dir)
        saved = json.loads((checkpoint_dir / PROGRESS_FILE).read_text())
        for part in self.data:  # where the data was, and what it had consumed (checked before the weights load)
            part.load_state_dict(saved)
        start = time.perf_counter()
        with self.stored.applied(), self.backend.loading_checkpoint():
            acc.load_state(str(checkpoint_dir))
        say(acc, f"loaded checkpoint {checkpoint_dir} in {time.perf_counter() - start:.2f} s")
        if progress.world_size != acc.num_processes:
            say(acc, f"checkpoint written by {progress.world_size} rank(s), resuming on {acc.num_processes}: "
                      "model and optimizer resharded; step, LR schedule and epoch carry over; the data position "
                      "carries over to within one global batch")
        if acc.process_index >= progress.world_size:
            # No saved RNG stream for this rank: a fresh one, the same on every resume.
            set_seed(seed + 1_000_003 * progress.step + acc.process_index)
            rank_warning(acc, f"no RNG state for this rank in {checkpoint_dir}; seeded from (seed, step, rank)")
        progress.world_size = acc.num_processes
        return progress
