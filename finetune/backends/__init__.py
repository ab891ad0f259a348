"""The backends a run can train on, chosen once from the accelerate config
`accelerate launch` was given. A new backend is a module with a `Backend`
subclass (finetune/backends/base.py lists what it answers) and a line here."""

from __future__ import annotations

from pathlib import Path

from finetune.backends.base import Backend
from finetune.backends.ddp import DDP, OneProcess
from finetune.backends.deepspeed import DeepSpeed
from finetune.backends.fsdp import FSDP1, FSDP2

# In the planner's table order.
REGISTRY: tuple[type[Backend], ...] = (
    DDP,
    FSDP2,
    FSDP1,
    DeepSpeed,
    OneProcess,
)


def requested_backend() -> Backend:
    """The backend the launch asks for; whole replicas (DDP, one process) only when no other is asked for."""
    for fallback in (False, True):
        for backend in REGISTRY:
            if backend.fallback == fallback and backend.requested():
                return backend()
    return OneProcess()


def for_checkpoint(checkpoint_dir: Path) -> Backend:
    """The backend whose layout a checkpoint is in (a model.safetensors checkpoint: one process or DDP)."""
    return next((backend() for backend in REGISTRY if not backend.fallback and backend.wrote(checkpoint_dir)),
                OneProcess())


def for_launch_config(launch: dict) -> type[Backend]:
    """The backend an accelerate config file (as a dict) runs."""
    return next((backend for backend in REGISTRY if backend.runs_launch_config(launch)), OneProcess)


def weights_in(path: Path) -> tuple[Backend, Path] | None:
    """The model weights a checkpoint dir holds (or `path` itself, when it is
    them), with the backend that reads them; None when there are none."""
    ordered = sorted(REGISTRY, key=lambda backend: backend.fallback)
    for backend in ordered:
        for candidate in (path / backend.weights_name, path):
            if backend.holds_weights(candidate):
                return backend(), candidate
    return None
