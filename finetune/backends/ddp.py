"""Whole replicas: DistributedDataParallel (ddp.yaml; MULTI_GPU over NCCL, or
MULTI_CPU over gloo on a CPU-only machine) and the one-process run."""

from __future__ import annotations

from finetune.backends.base import Backend, PlanInputs
from finetune.estimates import Estimate
from finetune.launch_request import launched_world_size


class OneProcess(Backend):
    """The base class's answers: one process holds everything."""
    fallback = True


class DDP(Backend):
    fallback = True

    @classmethod
    def requested(cls) -> bool:
        return launched_world_size() > 1

    @classmethod
    def runs_launch_config(cls, launch: dict) -> bool:
        return launch.get("distributed_type") in ("MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU")

    @classmethod
    def plan(cls, p: PlanInputs) -> list[Estimate]:
        """Everything on every device; under bf16 a compute-dtype copy of the weights too."""
        t = p.shape.trainable or p.shape.params
        return [Estimate("DDP", p.frozen_whole + p.trained_bytes * t, p.trained_bytes * t, 2 * p.trained_bytes * t,
                         p.shape.params * 2 if p.mixed_precision == "bf16" else 0, p.activations,
                         sharded=False, cpu_calibrated=True, reference=p.reference_whole)]
