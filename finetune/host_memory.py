"""This process's memory: the allocator settings a CPU run trains with, and
its resident set through a run's phases."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

MIB = 1024**2
# glibc's mmap threshold as keep_freed_memory_in_process sets it: smaller
# allocations come from the heap and are reused, larger ones are unmapped on free.
MMAP_THRESHOLD_BYTES = 32 * MIB


def glibc() -> ctypes.CDLL | None:
    """The C library whose malloc this process uses, where it is glibc's."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def keep_freed_memory_in_process() -> None:
    """On CPU every step allocates and frees the same activation and gradient
    buffers. glibc returns large freed blocks to the OS (mmap/munmap, heap
    trimming), so each step page-faults them in again: a fifth of the step time
    of small models. Raising the mmap threshold (to glibc's maximum) keeps them
    in the heap for reuse, as the CUDA caching allocator does on GPUs. The trim
    threshold and two arenas bound what the heaps keep beyond that: with a 1 GiB
    trim threshold and glibc's many per-thread arenas, a GPT-2 124M rank's RSS
    crept up by 0.5 GB over its first 30 steps before levelling off."""
    libc = glibc()
    if libc is None:  # not glibc (e.g. musl, macOS): leave the allocator alone
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold, m_arena_max = -1, -2, -3, -8
    libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES)  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
    libc.mallopt(m_trim_threshold, 256 * 1024 * 1024)
    libc.mallopt(m_top_pad, 64 * 1024 * 1024)
    libc.mallopt(m_arena_max, 2)


class HostMemory:
    """This process's resident set through a run's phases (load, final save),
    from the kernel's high-water mark (VmHWM), which Linux lets a process
    reset (`/proc/self/clear_refs`). Resetting it also resets ru_maxrss, so
    the peaks of earlier phases are kept here."""

    def __init__(self):
        self.at_start = resident_bytes()  # after the imports: what every phase is measured above
        self._earlier_peak = 0

    def peak(self) -> int:
        """The highest resident set since the last `restart`, or since the process started."""
        try:
            status = Path("/proc/self/status").read_text()
            return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
        except (OSError, ValueError, StopIteration):
            import resource

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB

    def lifetime_peak(self) -> int:
        return max(self._earlier_peak, self.peak())

    def restart(self) -> int:
        """Start a new phase: returns the resident set now, the base of the phase's rise.
        The heaps first hand back what they keep freed (up to the trim threshold,
        keep_freed_memory_in_process): otherwise the phase reuses it unseen, and
        its rise reads low by as much."""
        self._earlier_peak = self.lifetime_peak()
        release_freed_memory()
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass  # not Linux, or not allowed: the phase's peak is then the lifetime's
        return resident_bytes()


def release_freed_memory() -> None:
    """glibc's malloc_trim(0): free heap pages go back to the OS, in every arena."""
    if (libc := glibc()) is not None:
        libc.malloc_trim(0)


def resident_bytes() -> int:
    """This process's resident set now (Linux; 0 where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_memory_bytes(accelerator: Accelerator, host: HostMemory) -> int:
    """Peak memory of this rank: device allocator on GPU, resident set on CPU."""
    if accelerator.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(accelerator.device))
    return host.lifetime_peak()


