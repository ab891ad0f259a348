"""How many CPU threads a process computes with.

Launchers set OMP_NUM_THREADS=1 for their workers unless the user set it
(`accelerate launch` without --num_cpu_threads_per_process; torchrun always),
and torch sizes its thread pool from it: one process on a 2-core machine then
leaves a core idle (measured: 8.3 s per step against 4.4 s with both). So a
process gets the cores it may run on divided by the processes on this machine,
unless the user chose a number: OMP_NUM_THREADS in the shell that started the
launcher (or this process), or accelerate's --num_cpu_threads_per_process.
"""

from __future__ import annotations

import os
from pathlib import Path

from finetune.launch import launcher_options


def chosen_by_user() -> int | None:
    """The thread count the user set, if any."""
    launched = launcher_options()
    if launched is not None and "--num_cpu_threads_per_process" in " ".join(launched[0]):
        return int(os.environ["OMP_NUM_THREADS"])
    if "LOCAL_RANK" in os.environ or launched is not None:  # a launcher's worker: its OMP_NUM_THREADS may be the launcher's
        value = _launcher_environment().get("OMP_NUM_THREADS")
    else:
        value = os.environ.get("OMP_NUM_THREADS")
    try:
        return max(1, int(value)) if value else None
    except ValueError:
        return None


def _launcher_environment() -> dict[str, str]:
    """The environment the launcher (this process's parent) was started with."""
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def use_cpu_threads() -> tuple[int, str]:
    """Set torch's thread count; returns it and where it came from."""
    import torch

    user = chosen_by_user()
    if user is not None:
        torch.set_num_threads(user)
        return user, "OMP_NUM_THREADS"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = max(1, cores // local_processes)
    torch.set_num_threads(threads)
    return threads, f"{cores} cores / {local_processes} process(es) here; OMP_NUM_THREADS sets another number"


def cpu_threads_line(threads: tuple[int, str]) -> str:
    """What the one-process commands say of `use_cpu_threads()` when they are done."""
    return f"used {threads[0]} CPU thread(s) ({threads[1]})"
