"""Collectives the run is built from: gloo's all-gather and reduce-scatter in
the form FSDP2 runs fastest on CPU, tensors served whole to the main process
one at a time, and writes and checks that every rank agrees on."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

from finetune.errors import UsageError
from finetune.liveness import is_collective_timeout


# FSDP2 over gloo.
# Measured between two processes on one machine (1 thread each, fp32), FSDP2's
# default collectives against what these classes do instead:
#   reduce-scatter, 16 / 64 / 128 MB: 31 / 162 / 280 ms; all-reduce: 14 / 59 / 107 ms
#   all-gather, 32 / 64 / 128 MB: 55 / 132 / 235 ms; in 4 MB pieces, two in flight: 27 / 51 / 96 ms
# Both implement FSDP2's comm interface (`allocate`, then the call), which
# `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter` accept.

GLOO_ALL_GATHER_PIECE_BYTES = 4 * 2**20


class _HostBuffers:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class GlooReduceScatter(_HostBuffers):
    """gloo's reduce-scatter is slower than its all-reduce of the whole input,
    which every rank then reads its own part of. FSDP2's input is a temporary
    buffer of its own, so the all-reduce works in place."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        torch.distributed.all_reduce(input_tensor, op=op, group=group)
        rank = torch.distributed.get_rank(group)
        output_tensor.copy_(input_tensor.narrow(0, rank * output_tensor.numel(), output_tensor.numel()))


class GlooAllGather(_HostBuffers):
    """gloo's all-gather of one large tensor between two processes runs at half
    the speed of the same bytes in pieces (gloo#471); two pieces in flight keep
    its temporary buffers small. Each piece lands directly in its place in the
    rank-major output."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        world, n = torch.distributed.get_world_size(group), input_tensor.numel()
        piece = max(1, GLOO_ALL_GATHER_PIECE_BYTES // (input_tensor.element_size() * world))
        in_flight = []
        for start in range(0, n, piece):
            end = min(n, start + piece)
            places = [output_tensor[rank * n + start: rank * n + end] for rank in range(world)]
            in_flight.append(torch.distributed.all_gather(places, input_tensor[start:end], group=group, async_op=True))
            if len(in_flight) == 2:
                in_flight.pop(0).wait()
        for work in in_flight:
            work.wait()
        return None  # done: FSDP2 waits only on what is returned


def whole_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor whole, on every rank (a collective): DTensors split on
    their first dimension over one mesh dimension (FSDP2's layout) in one
    all-gather per dtype, as FSDP2 gathers a unit; any other DTensor by its
    own `full_tensor()`; a plain tensor as it is."""
    from torch.distributed.tensor import Shard

    out: list[torch.Tensor | None] = [None] * len(tensors)
    batched: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if not hasattr(t, "full_tensor"):
            out[i] = t.detach()
        elif t.device_mesh.ndim == 1 and t.placements[0] == Shard(0) and t.dim() > 0:
            batched.setdefault((t.dtype, t.device_mesh), []).append(i)
        else:
            out[i] = t.full_tensor().detach()
    for (dtype, mesh), indices in batched.items():
        world = mesh.size()

        def part(i: int, rank: int) -> int:
            """Elements of tensor i on `rank`: torch.chunk's rows, as FSDP2 splits."""
            shape = tensors[i].shape
            rows = -(-shape[0] // world)
            return max(0, min(shape[0], (rank + 1) * rows) - rank * rows) * shape[1:].numel()

        sizes = [[part(i, rank) for i in indices] for rank in range(world)]
        width = max(sum(s) for s in sizes)
        local = torch.cat([tensors[i].to_local().detach().reshape(-1) for i in indices])
        flat = torch.zeros(width, dtype=dtype, device=mesh.device_type)  # a CPU-offloaded shard goes to the GPU
        flat[:len(local)] = local
        pieces = [torch.empty_like(flat) for _ in range(world)]
        torch.distributed.all_gather(pieces, flat, group=mesh.get_group())
        offsets = [0] * world
        for j, i in enumerate(indices):
            parts = []
            for rank in range(world):
                parts.append(pieces[rank][offsets[rank]:offsets[rank] + sizes[rank][j]])
                offsets[rank] += sizes[rank][j]
            out[i] = torch.cat(parts).view(tensors[i].shape)
    return out


def use_gloo_collectives(model: torch.nn.Module) -> None:
    """FSDP2 over gloo (CPU): the collectives above, in every FSDP unit."""
    from torch.distributed.fsdp import FSDPModule

    if not torch.distributed.is_initialized() or torch.distributed.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(GlooAllGather())
            module.set_custom_reduce_scatter(GlooReduceScatter())


def gather_ints(accelerator: Accelerator, value: int) -> list[int]:
    """One integer from every rank, in rank order."""
    return [int(n) for n in accelerator.gather(torch.tensor([value], dtype=torch.long, device=accelerator.device)).tolist()]


def broadcast_from_main(value):
    """The main process's `value` (any picklable object) on every rank."""
    return broadcast_object_list([value])[0]


def serve_full_tensors(accelerator: Accelerator, tensors: dict[str, torch.Tensor], consume) -> None:
    """Hand `consume`, on the main process, a `fetch(names)` that returns those
    tensors whole (sharded ones gathered from every rank, on CPU), while the
    other ranks take part in each gather until the main process is done. No
    rank holds more than what `consume` keeps plus one tensor being gathered,
    instead of the whole state on the main process."""
    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().to("cpu")

    if not accelerator.is_main_process:
        while (names := broadcast_from_main(None)) is not None:
            for name in names:
                whole(tensors[name])
        return

    def fetch(names: list[str]) -> dict[str, torch.Tensor]:
        broadcast_from_main(names)
        return {name: whole(tensors[name]) for name in names}
    try:
        consume(fetch)
    finally:
        broadcast_from_main(None)  # the others stop serving, also when consume failed


def check_same_layout(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Every rank's model has the main process's parameter names, shapes and
    dtypes: the weights are sent tensor by tensor in that order, and a rank
    that built another layout would receive the wrong bytes."""
    layout = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    main_layout = broadcast_from_main(layout)
    if layout != main_layout:
        name = next((a[0] for a, b in zip(layout, main_layout) if a != b),
                    f"{len(layout)} parameters against {len(main_layout)}")
        raise RuntimeError(f"rank {accelerator.process_index} built another model than the main process ({name} "
                           "differs); every rank must build the same architecture")


def main_process_first(accelerator: Accelerator, action):
    """`action()` on the main process first (it fills the caches), then on the
    others. When the main process finds bad input, every rank raises its
    UsageError, so each exits with the one-line error instead of waiting at a
    barrier the main process never reaches (and dying with a gloo traceback)."""
    if accelerator.num_processes == 1:
        return action()
    verdict = [None]
    if accelerator.is_main_process:
        try:
            result = action()
        except UsageError as e:
            verdict = [str(e)]
    broadcast_object_list(verdict, from_process=0)
    if verdict[0] is not None:
        raise UsageError(verdict[0])
    return result if accelerator.is_main_process else action()


class WriteFailed(Exception):
    """A write failed on some rank; the message is that rank's reason."""


# torch.save reports a full disk as a RuntimeError, safetensors as a SafetensorError.
WRITE_ERRORS = (OSError, CheckpointException, RuntimeError, SafetensorError)


def on_every_rank(accelerator: Accelerator, action, errors: tuple[type[BaseException], ...] = WRITE_ERRORS) -> None:
    """Run `action` on this rank, then agree with the others (one collective)
    on whether it failed anywhere with one of `errors` (by default OS errors: a
    full disk, a read-only dir): if so, every rank raises WriteFailed with the
    first rank's reason, instead of one rank dying and the others waiting for it."""
    reason = None
    try:
        action()
    except errors as e:
        if is_collective_timeout(e):
            raise
        reason = _reason(e)
    reasons = [reason] if accelerator.num_processes == 1 else gather_object([reason])
    failed = [r for r in reasons if r is not None]
    if failed:
        raise WriteFailed(failed[0])


def _reason(error: BaseException) -> str:
    """The OS's words for the first OS error inside (DCP wraps each rank's in a CheckpointException)."""
    if isinstance(error, OSError):
        return error.strerror or type(error).__name__
    for failure in getattr(error, "failures", {}).values():  # rank -> (exception, traceback)
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, BaseException):
            return _reason(cause)
    first_line = str(error).strip().splitlines()[0][:100] if str(error).strip() else ""
    return f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__


