"""The checks of an --output_dir that need nothing but the file system: they run
first, before the libraries load (seconds on every rank), so a wrong dir fails
at once. And the default run dir's name, which every rank must agree on."""

from __future__ import annotations

import itertools
import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from finetune.errors import RankLost, UsageError, missing_or_odd, why_it_cannot_be_made

if TYPE_CHECKING:
    from finetune.config import TrainConfig


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuse to mix two runs in one dir. Runs on every rank before the process
    group exists, so no rank can see a file another one just wrote."""
    run_dir = Path(cfg.output_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--output_dir {run_dir} is a file, not a directory; choose another --output_dir")
    if problem := why_it_cannot_be_made(run_dir):
        reason = f"written ({problem})" if problem.endswith("read-only") else f"made: {problem}"
        raise UsageError(f"--output_dir {run_dir} cannot be {reason}; choose another --output_dir")
    if link := first_link_inside(run_dir):
        kind = "directory" if link.is_dir() else "file"
        raise UsageError(f"{link} is a symbolic link (to {os.readlink(link)}); a run never writes or removes through "
                         f"a link in its run dir: put the real {kind} there, or choose another --output_dir")
    if cfg.resume_from_checkpoint or cfg.overwrite or failed_start(run_dir):
        return
    if (run_dir / "run_config.yaml").exists() or (run_dir / "checkpoints").exists():
        raise UsageError(f"{run_dir} already holds a run; resume it with `finetune resume {run_dir}`, "
                         "pass --overwrite, or choose another --output_dir")


# What a run writes only once it has trained: a (complete) checkpoint, its final model, its summary.
RESULTS = ("checkpoints", "final", "summary.json")


def failed_start(run_dir: Path) -> bool:
    """A run dir whose run started writing (its run_config.yaml) but left
    nothing to continue from or keep: it failed (or was killed) before its first
    checkpoint. It is not in the way of a new run there, which starts it afresh
    (`RunLock` still refuses a live one)."""
    return (run_dir / "run_config.yaml").is_file() and not has_results(run_dir)


def has_results(run_dir: Path) -> bool:
    return bool(checkpoint_dirs(run_dir)) or any((run_dir / name).exists() for name in RESULTS[1:])


CHECKPOINT_PREFIX = "step_"
PROGRESS_FILE = "training_progress.json"  # a complete checkpoint's: the step, the data's position


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run, in no order. Temporary dirs are
    never listed, and neither are symlinks: a link may point outside the run,
    and pruning must never delete through one."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name.startswith(CHECKPOINT_PREFIX)
            and p.name[len(CHECKPOINT_PREFIX):].isdigit()]


def starts_afresh(run_dir: Path) -> bool:
    """Nothing in the run dir is worth keeping if this run fails before its
    first checkpoint: it does not exist yet, is empty, or holds a failed start."""
    return not run_dir.exists() or not any(run_dir.iterdir()) or failed_start(run_dir)


# What the trackers keep in a run dir, with links of their own (wandb's latest-run): finetune never writes there.
TRACKER_DIRS = ("wandb", "mlruns")


def first_link_inside(run_dir: Path) -> Path | None:
    """A symbolic link under the run dir (which itself may be one), if any,
    outside what the trackers keep (those dirs themselves may not be links)."""
    if not run_dir.is_dir():
        return None
    for parent, dirs, files in os.walk(run_dir):  # does not descend into linked directories
        for name in sorted(dirs + files):
            if (path := Path(parent) / name).is_symlink():
                return path
        if Path(parent) == run_dir:
            dirs[:] = [d for d in dirs if d not in TRACKER_DIRS]
    return None


# Runs this process has named: every rank of a launch names the same runs in
# the same order, so the count tells one run's name from the next's (ranks
# that run several commands in one process, as `main` called from Python does).
_NAMED = itertools.count()


def named_by_rank_zero(local_name: str, timeout_s: int) -> str:
    """The default run dir (outputs/TASK-TIME) as rank 0 named it. Each rank
    reads its own clock, and two ranks may read it a second apart: they would
    write two run dirs. Before the process group exists, the ranks share the
    launcher's store (torchrun's, at MASTER_ADDR:MASTER_PORT), where rank 0
    leaves its name for the others."""
    n = next(_NAMED)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return local_name
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        raise UsageError("the ranks of this launch cannot agree on a default run dir before they connect (no "
                         "torchrun store); pass --output_dir, or launch with accelerate launch or torchrun")
    from torch.distributed import TCPStore

    key = f"finetune/default_run_dir/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{n}"
    try:
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))
        if os.environ.get("RANK", "0") == "0":
            store.set(key, local_name)
            return local_name
        return store.get(key).decode()
    except RuntimeError:  # the store's timeout (DistStoreError)
        raise RankLost(f"rank 0 did not name the run dir within {timeout_s} s (--ddp_timeout); it stopped before "
                       "training: see its error above, or pass --output_dir") from None


def checkpoint_step(checkpoint_dir: Path) -> int:
    return int(checkpoint_dir.name[len(CHECKPOINT_PREFIX):])


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (see run_dir.checkpoint_dirs)."""
    return sorted(checkpoint_dirs(run_dir), key=checkpoint_step)


def no_checkpoint_message(run_dir: Path) -> str:
    if (run_dir / "final").is_dir():
        return (f"{run_dir} finished with no checkpoint to continue from (--checkpoint_at_end false, or they were "
                f"removed); train its final model further: --model {run_dir / 'final'} with a new --output_dir")
    return (f"no complete checkpoint under {run_dir / 'checkpoints'} to resume from: the run stopped before its "
            "first one; run its training command again (it starts afresh there; --resume_from_checkpoint auto "
            "does the same when there is none)")


def resolve_checkpoint(run_dir: str | Path, spec: str) -> Path | None:
    """Turn `latest`, `auto` or a path into a checkpoint dir, with clear errors.
    `auto` is `latest` when there is a complete checkpoint and None (start
    fresh) when there is none: one job script survives preemption and requeueing."""
    if spec == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    if spec == "latest":
        found = complete_checkpoints(run_dir)
        if not found:
            raise UsageError(no_checkpoint_message(Path(run_dir)))
        return found[-1]
    path = Path(spec)
    if not path.is_dir():
        raise UsageError(f"--resume_from_checkpoint {spec} {missing_or_odd(path)}, not a checkpoint dir; pass a "
                         "checkpoints/step_NNNNNN dir, 'latest' or 'auto'")
    if not (path / PROGRESS_FILE).is_file():
        raise UsageError(f"{spec} is not a checkpoint of this tool (no {PROGRESS_FILE}); "
                         "pass a checkpoints/step_NNNNNN dir or 'latest'")
    return path


def saved_config(checkpoint_dir: Path) -> dict:
    """The run config a checkpoint was written with ({} for one without)."""
    try:
        saved = yaml.safe_load((checkpoint_dir / "run_config.yaml").read_text(encoding="utf-8"))
    except OSError:
        return {}
    except (yaml.YAMLError, UnicodeDecodeError):
        raise UsageError(f"{checkpoint_dir / 'run_config.yaml'} is not valid YAML; the checkpoint is damaged, "
                         "resume from an earlier one") from None
    return saved if isinstance(saved, dict) else {}
