"""What this machine has: accelerator devices, native bf16 on the CPU, and
the processes the launcher started on it."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from accelerate import Accelerator

from finetune.errors import UsageError


def cpu_has_native_bf16() -> bool:
    """bf16 matmuls are fast only with AVX512-BF16 or AMX; elsewhere (AVX2-only
    CPUs) they were measured 30-250x slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # not Linux: do not guess
    return "avx512_bf16" in flags or "amx_bf16" in flags


def device_name(device: torch.device) -> str:
    """What a rank computes on, as a person names it (its model card says so)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown model"
    return f"CPU ({model}, {os.cpu_count()} cores)" if device.type == "cpu" else f"{device.type} ({model})"


def slow_bf16_warning(accelerator: Accelerator) -> str | None:
    if accelerator.mixed_precision == "bf16" and accelerator.device.type == "cpu" and not cpu_has_native_bf16():
        return ("warning: bf16 on this CPU (no avx512_bf16/amx_bf16) makes matmuls far slower than fp32; "
                "add --mixed_precision no to accelerate launch for speed")
    return None


def check_processes_fit_devices() -> None:
    """One process per GPU: more would share a GPU (and NCCL refuses that)."""
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and local_processes > torch.cuda.device_count():
        raise UsageError(f"{local_processes} processes on this machine but only {torch.cuda.device_count()} GPU(s); "
                         f"pass --num_processes {torch.cuda.device_count()} to accelerate launch (one process per GPU)")


