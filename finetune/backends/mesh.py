"""The device mesh: how the ranks split the work, as Accelerate's
`parallelism_config` asks (the `parallelism_config_*` keys of an accelerate
config, or `--parallelism_config_*` on `accelerate launch`) and as the
parameters of a prepared model show it.

    dp_replicate  whole copies of the (sharded) model; gradients are averaged across them
    dp_shard      ranks each copy's parameters, gradients and optimizer state are split over (FSDP)
    tp            ranks each layer's matrices are split over (tensor parallel, under FSDP2);
                  they read the same batch, so the loop counts batches by the data-parallel size

HSDP is dp_replicate > 1 with dp_shard > 1: on N nodes of G GPUs, replicate N and
shard G keeps every per-layer collective inside a node.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from finetune.errors import UsageError
from finetune.launch_request import check_mesh_size, requested_mesh

@dataclass(frozen=True)
class Mesh:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"{self.dp_replicate} replicas" if self.dp_replicate > 1 else "",
                 f"{self.dp_shard} shards" if self.dp_shard > 1 else "",
                 f"tensor parallel {self.tp}" if self.tp > 1 else ""]
        return " x ".join(p for p in parts if p) or "1 rank"


def check_requested_mesh(world_size: int, takes: frozenset[str], layout: str, on_gpu: bool) -> None:
    """One line, before any process group, for a mesh this run cannot have.
    `takes`: the mesh dimensions the backend lays a model out on ("dp_replicate",
    "dp_shard", "tp"); `layout`: the backend, for messages."""
    sizes = requested_mesh()
    if sizes is None:
        return
    for name in ("cp_size", "sp_size"):
        if sizes[name] > 1:
            kind = "context" if name == "cp_size" else "sequence"
            where = ("needs GPUs (its attention kernels are CUDA's) and this machine has none" if not on_gpu
                     else "is not run by finetune's training loop")
            raise UsageError(f"parallelism_config_{name}: {sizes[name]} asks for {kind} parallelism, which {where}; "
                             "set it to 1 (for long sequences, fsdp_activation_checkpointing.yaml saves activation "
                             "memory instead)")
    unsupported = [f"{dim} {sizes[dim + '_size']}" for dim in ("dp_replicate", "dp_shard", "tp")
                   if sizes[dim + "_size"] > 1 and dim not in takes]
    if unsupported:
        raise UsageError(f"the parallelism_config asks for {', '.join(unsupported)}, which this launch's backend "
                         f"({layout}) does not lay a model out on; launch replicas and shards (HSDP) with "
                         "`--config_file $(finetune configs --path hsdp)`")
    check_mesh_size(world_size)
    if "dp_shard" in takes and sizes["dp_shard_size"] == 1 and world_size > 1:
        if sizes["tp_size"] > 1:
            raise UsageError(f"tensor parallel {sizes['tp_size']} on {world_size} processes leaves FSDP nothing to "
                             "shard over (parallelism_config_dp_shard_size: 1), and tensor parallelism runs under "
                             "FSDP here; launch 2 or more shards of tp_size ranks, e.g. tp.yaml's 2 x 2 on 4 "
                             "processes")
        raise UsageError("the parallelism_config leaves FSDP nothing to shard over (parallelism_config_dp_shard_size: "
                         "1); set dp_shard_size to the ranks each copy is split over, or launch whole replicas with "
                         "`--config_file $(finetune configs --path ddp)`")


def tensor_parallel_size(accelerator) -> int:
    """Ranks each layer's matrices are split over (1: none)."""
    config = accelerator.parallelism_config
    return config.tp_size if config is not None else 1


def data_parallel_size(accelerator) -> int:
    """Ranks that read different batches: the world size, divided by the
    tensor-parallel ranks that share one."""
    return accelerator.num_processes // tensor_parallel_size(accelerator)


def asked_fsdp_mesh(accelerator) -> Mesh:
    """What an FSDP launch asked for; without a parallelism_config, shards over every rank."""
    n = accelerator.num_processes
    sizes = requested_mesh()
    if sizes is None:
        return Mesh(dp_shard=n) if n > 1 else Mesh()
    return Mesh(sizes["dp_replicate_size"], sizes["dp_shard_size"], sizes["tp_size"])


def config_sizes(launch: dict) -> dict[str, int]:
    """The sizes an accelerate config file's parallelism_config sets, by
    accelerate's names without the prefix (dp_replicate_size, tp_size, ...)."""
    section = launch.get("parallelism_config")
    sizes = {}
    for key, value in (section.items() if isinstance(section, dict) else ()):
        name = str(key).removeprefix("parallelism_config_")
        if name.endswith("_size"):
            if not str(value).isdigit() or int(value) < 1:
                raise UsageError(f"parallelism_config: {key}: {value!r} is not a positive number of ranks; "
                                 "fix it in the accelerate config")
            sizes[name] = int(value)
    return sizes


def mesh_of(model: torch.nn.Module) -> Mesh | None:
    """The mesh the model's parameters are laid out on, read from their DTensor
    device meshes; None when no parameter is a DTensor."""
    from torch.distributed.tensor import DTensor

    meshes = [p.device_mesh for p in model.parameters() if isinstance(p, DTensor)]
    if not meshes:
        return None
    replicate = shard = tp = 1
    for mesh in meshes:
        sizes = dict(zip(mesh.mesh_dim_names or ("dp_shard",) * mesh.ndim, mesh.shape))
        replicate = max(replicate, math.prod(s for n, s in sizes.items() if n == "dp_replicate"))
        tp = max(tp, math.prod(s for n, s in sizes.items() if n == "tp"))
        shard = max(shard, math.prod(s for n, s in sizes.items() if n not in ("dp_replicate", "tp")))
    return Mesh(replicate, shard, tp)
