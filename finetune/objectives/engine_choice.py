"""Which generation engine a run samples with (--generation_engine, engines.py
and vllm_engine.py): the one asked for, or auto's pick, with the reason the
start line gives; an engine that cannot run here is refused in one line."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate import Accelerator

from finetune.backends.base import Backend
from finetune.collectives import gather_ints
from finetune.errors import UsageError
from finetune.objectives import vllm_engine
from finetune.objectives.engines import AsHeld, Replica, gigabytes


def engine_classes() -> dict[str, type[AsHeld]]:
    return {engine.name: engine for engine in (AsHeld, Replica, vllm_engine.VLLMColocate)}


@dataclass
class EngineChoice:
    name: str
    why: str


def choose_engine(requested: str, accelerator: Accelerator, backend: Backend, model: torch.nn.Module,
                  images: bool = False) -> EngineChoice:
    """The engine --generation_engine names, or `auto`'s pick, with the reason
    the start line gives; an engine that cannot run here (`replica` where a
    whole copy cannot fit at all, `vllm` without a vLLM for this device) is
    refused in one line before it is built. `images`: the prompts hold
    images, which only transformers' `generate` is given."""
    if requested == "vllm":
        return EngineChoice("vllm", vllm_engine.refusal_or_reason(accelerator, asked=True))
    whole, free = replica_bytes(accelerator, backend, model), least_free(accelerator)
    if requested == "replica" and whole > free:
        raise UsageError(f"--generation_engine replica keeps a whole copy of the policy ({gigabytes(whole)}) on each "
                         f"rank, and {gigabytes(free)} is free beside training; pass --generation_engine sharded "
                         "(or auto)")
    if requested != "auto":
        return EngineChoice(requested, f"as asked; a whole copy would be {gigabytes(whole)}")
    if accelerator.device.type == "cuda" and vllm_engine.installed() and not images:
        return EngineChoice("vllm", vllm_engine.refusal_or_reason(accelerator, asked=False))
    if not backend.shards_parameters(accelerator):
        return EngineChoice("sharded", "each rank holds the whole model: nothing to gather")
    if whole <= free // 2:
        return EngineChoice("replica", f"a whole copy, {gigabytes(whole)}, fits in half of the {gigabytes(free)} "
                                       "free beside training")
    return EngineChoice("sharded", f"a whole copy, {gigabytes(whole)}, does not fit in half of the {gigabytes(free)} "
                                   "free beside training")


def replica_bytes(accelerator: Accelerator, backend: Backend, model: torch.nn.Module) -> int:
    policy = accelerator.unwrap_model(model)
    return backend.whole_parameter_count(policy) * torch.finfo(backend.sampling_dtype(policy)).bits // 8


def least_free(accelerator: Accelerator) -> int:
    """The least memory free on any rank: every rank must pick the same engine
    (a rank sampling from a replica would leave the others waiting in a gather)."""
    free = free_memory(accelerator.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return min(gather_ints(accelerator, free))
    return free


def free_memory(device: torch.device) -> int:
    """Bytes free on the device now: the GPU's, or the host's available memory for a CPU run."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available
