"""Parameters as the model names and counts them, whatever wraps them (FSDP
shards, DDP, activation checkpointing, torch.compile, ZeRO-3 partitions)."""

from __future__ import annotations

import re

import torch

# Modules that wrappers put into live parameter names but that saved state
# dicts leave out: activation checkpointing, FSDP1, torch.compile.
WRAPPER_MODULES = {"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"}


def canonical_name(name: str) -> str:
    """A parameter's name as the model itself (and every checkpoint) calls it,
    whatever wrapped it: the wrappers above anywhere in the path, DDP's
    `module.` at its start."""
    parts = [part for part in name.split(".") if part not in WRAPPER_MODULES]
    if parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts)


def base_model_name(name: str) -> str:
    """A name under peft's adapter wrappers as the base model calls it: without
    `base_model.model.` and each `.base_layer` (nested where one module has
    several adapted parameters)."""
    return re.sub(r"(\.base_layer)+\.", ".", name.removeprefix("base_model.model."))


def local_numel(param: torch.Tensor) -> int:
    """Elements of the parameter this rank holds: its FSDP shard, its ZeRO-3 partition, or all."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor.numel()
    return param.to_local().numel() if hasattr(param, "to_local") else param.numel()


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter (a ZeRO-3 parameter's own tensor is empty outside forward and backward)."""
    return getattr(param, "ds_numel", param.numel())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds; a subclass's are its inner tensors' (a 4-bit
    base weight: its codes and their scales, not numel x its bf16 dtype)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        return sum(held_bytes(getattr(t, name)) for name in inner)
    return t.numel() * t.element_size()


def tally(tensors) -> dict[str, int]:
    local = [local_tensor(t) for t in tensors]
    return {"elements": sum(t.numel() for t in local), "bytes": sum(held_bytes(t) for t in local)}


