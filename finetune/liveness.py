"""Whether the other ranks are still there: a rank ends with its launcher, and
a rank whose collective timed out names the ranks that went quiet."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
from pathlib import Path

from accelerate import Accelerator

from finetune.errors import RankLost


def end_with_launcher() -> None:
    """A rank that `accelerate launch` (or torchrun) started gets SIGTERM when
    the launcher dies, even by SIGKILL: orphaned ranks would go on holding
    memory, devices and the run's lock. SIGTERM is a clean stop: the ranks
    agree on it, save a checkpoint and exit (finetune/stopping.py). Linux only."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # the launcher was already gone before we asked
        os.kill(os.getpid(), signal.SIGTERM)


class Heartbeats:
    """Each rank touches its file after every optimizer step; the file holds the
    rank's pid and host. A rank whose collective timed out names the ranks whose
    files went quiet (a hung or stopped process, a lost machine) and ends those
    on its own machine: the launcher would otherwise wait 30 s on a stopped
    process before it kills it."""

    def __init__(self, run_dir: Path, accelerator: Accelerator, timeout_s: int):
        self.dir = Path(run_dir) / ".heartbeats"
        self.rank, self.world_size, self.timeout_s = accelerator.process_index, accelerator.num_processes, timeout_s
        self.started = False

    def beat(self) -> None:
        if self.world_size == 1:
            return
        file = self.dir / f"rank{self.rank}"
        if not self.started:
            self.dir.mkdir(exist_ok=True)
            file.write_text(f"{os.getpid()} {socket.gethostname()}")
            self.started = True
        else:
            file.touch()

    def lost(self, error: BaseException) -> RankLost:
        now = time.time()
        quiet = [r for r in range(self.world_size) if r != self.rank and now - self._last_beat(r) > self.timeout_s / 2]
        who = f"rank(s) {', '.join(map(str, quiet))}" if quiet else "another rank"
        ended = [f"rank {r}'s process (pid {pid})" for r in quiet if (pid := self._end_sibling(r))]
        what_next = (f"ended {', '.join(ended)} on this machine; continue" if ended and len(ended) == len(quiet)
                     else "once it is running again, or gone, continue")
        return RankLost(f"[rank {self.rank}] {who} stopped answering: no collective completed within --ddp_timeout "
                        f"{self.timeout_s} s ({type(error).__name__}); {what_next} "
                        f"with `finetune resume {self.dir.parent}`")

    def _last_beat(self, rank: int) -> float:
        try:
            return (self.dir / f"rank{rank}").stat().st_mtime
        except OSError:
            return 0.0

    def _end_sibling(self, rank: int) -> int | None:
        """SIGKILL a quiet rank that runs on this machine under our own launcher
        (its parent is ours, so the pid was not reused); its pid, or None."""
        try:
            pid_text, host = (self.dir / f"rank{rank}").read_text().split()
            pid = int(pid_text)
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if host != socket.gethostname() or parent != os.getppid() or pid == os.getpid():
            return None
        # This rank ends with the line that says why; the launcher's SIGTERM, which
        # follows the kill, must not cut it short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            return None
        return pid


def is_collective_timeout(error: BaseException) -> bool:
    """gloo and NCCL say so in their messages; torch wraps them in RuntimeError or DistBackendError."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text)


