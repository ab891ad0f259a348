"""One live run per run dir: an advisory lock file holding the owner's pid
and host, taken by the main process before the run writes anything and
released when it ends. A lock whose process is gone (same host) is stale and
taken over; every rank reaches the same verdict."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from finetune.errors import UsageError

LOCK_FILE = ".finetune.lock"


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class RunLock:
    def __init__(self, run_dir: Path, accelerator: Accelerator):
        self.path = Path(run_dir) / LOCK_FILE
        self.accelerator = accelerator
        self.held = False
        self.taken = False  # this process held the lock at some point: the run dir was its own

    def __enter__(self) -> "RunLock":
        verdict = [self._acquire() if self.accelerator.is_main_process else None]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(verdict)
        if verdict[0]:
            raise UsageError(verdict[0])
        return self

    def __exit__(self, *exc) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def _acquire(self) -> str | None:
        """None when the lock is ours, else the one-line refusal."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):  # a second try after removing a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder and holder.get("host") == me["host"] and not process_alive(holder["pid"]):
                    print(f"note: {self.path} was left by pid {holder['pid']}, which is no longer running: "
                          "taking it over")
                    self.path.unlink(missing_ok=True)
                    continue
                who = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}" if holder \
                    else "another process"
                return (f"{self.path.parent} is in use by a live run ({who}); wait for it to end, or remove "
                        f"{self.path} if that process is gone")
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = self.taken = True
            return None
        return f"could not take {self.path}; remove it if no run is using {self.path.parent}"

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int) or holder["pid"] <= 0:
            return None
        return holder


def empty_run_dir(run_dir: Path) -> None:
    """Removes everything in a run dir but its lock, which the caller holds."""
    for entry in run_dir.iterdir():
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def remove_new_run_dir(run_dir: Path, new_parents: list[Path], keep_dir: bool = False) -> None:
    """Removes what a run wrote into a run dir that held nothing to keep
    (`run_dir.starts_afresh`) when it failed before its first checkpoint, under
    its lock taken again: never while another process holds it, so nothing
    another run put there is removed. Then the dir itself unless `keep_dir`
    (it was there before), and the parents made for it, nearest first, while
    they are empty."""
    lock = run_dir / LOCK_FILE
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except OSError:
        return  # another run took the dir (or it is gone): it stays as it is
    empty_run_dir(run_dir)
    lock.unlink(missing_ok=True)
    if keep_dir:
        return
    for made in (run_dir, *new_parents):
        try:
            made.rmdir()
        except OSError:
            return  # something arrived after the lock was released, or another run's dir
