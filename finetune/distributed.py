"""Building the Accelerator, real FSDP on CPU-only machines, and the checks that
a run which asked for FSDP really is sharded.

Accelerate only selects FSDP when it finds an accelerator device: on a CPU-only
machine `accelerate launch --config_file accelerate_configs/fsdp.yaml` starts
the processes, but each one ends up alone (`NO`) or in plain DDP (`MULTI_CPU`)
with the FSDP plugin silently dropped. PyTorch's FSDP2 (`fully_shard`) runs on
CPU over gloo, so `enable_fsdp_on_cpu` sets up the gloo process group and hands
it to Accelerate as a multi-device one; Accelerate then builds its FSDP state
and `prepare` shards the model exactly as it would on GPUs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (DataLoaderConfiguration, broadcast_object_list, DistributedType, GradientAccumulationPlugin,
                               InitProcessGroupKwargs, ProjectConfiguration,
                               gather_object)
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

from finetune.errors import NotDistributed, RankLost, UsageError
from finetune.memory import MMAP_THRESHOLD_BYTES


def fsdp_requested() -> bool:
    """True when the accelerate config (via `accelerate launch`) asks for FSDP."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def deepspeed_requested() -> bool:
    """True when the accelerate config asks for DeepSpeed (zero1/2/3.yaml)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def has_accelerator_device() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def cpu_has_native_bf16() -> bool:
    """bf16 matmuls are fast only with AVX512-BF16 or AMX; elsewhere (AVX2-only
    CPUs) they were measured 30-250x slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # not Linux: do not guess
    return "avx512_bf16" in flags or "amx_bf16" in flags


def slow_bf16_warning(accelerator: Accelerator) -> str | None:
    if accelerator.mixed_precision == "bf16" and accelerator.device.type == "cpu" and not cpu_has_native_bf16():
        return ("warning: bf16 on this CPU (no avx512_bf16/amx_bf16) makes matmuls far slower than fp32; "
                "add --mixed_precision no to accelerate launch for speed")
    return None


def check_fsdp_options_supported_here() -> None:
    """FSDP1 and parameter offload need an accelerator device (measured: FSDP1
    rejects `cpu:0`, FSDP2's CPUOffloadPolicy needs a device to offload from)."""
    if has_accelerator_device() or not fsdp_requested():
        return
    if os.environ.get("FSDP_VERSION", "2") == "1":
        raise UsageError("fsdp_version: 1 (FSDP1) needs a GPU and this machine has none; "
                         "launch with `--config_file $(finetune configs --path fsdp)` (FSDP2), which runs on CPU")
    if os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
        raise UsageError("fsdp_offload_params: true (CPU offload) needs a GPU to offload from and this machine has none; "
                         "launch with `--config_file $(finetune configs --path fsdp)`")


def import_deepspeed_only_for_deepspeed_runs() -> None:
    """Accelerate's unwrap (in `prepare`, and at every save) imports DeepSpeed
    whenever it is installed, only to compare the model with DeepSpeed's engine:
    1.1 s and 66 MB per rank (measured), in runs that never use it. A DeepSpeed
    run imports it here, with the other imports, so that its memory phases
    measure what they say (the load phase: the weights); any other run holds
    no engine, and Accelerate's unwrap is told so."""
    import accelerate.utils.imports
    import accelerate.utils.other

    uses_deepspeed = deepspeed_requested()
    accelerate.utils.other.is_deepspeed_available = (accelerate.utils.imports.is_deepspeed_available if uses_deepspeed
                                                     else lambda: False)
    if uses_deepspeed:
        import deepspeed  # noqa: F401


def find_deepspeed_config() -> None:
    """The shipped zero*.yaml name their DeepSpeed JSON by file name: a path
    from the working directory when there is one, else the shipped file of
    that name (so the configs work from any directory)."""
    from finetune.launch_configs import CONFIG_DIR

    named = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not named or named == "none" or Path(named).is_file():
        return
    if (CONFIG_DIR / Path(named).name).is_file() and Path(named).name == named:
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(CONFIG_DIR / named)
        return
    raise UsageError(f"deepspeed_config_file {named} (from the accelerate config) does not exist; give its path from "
                     "the working directory, or launch with `--config_file $(finetune configs --path zero2)`")


def check_deepspeed_installed() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise UsageError("the accelerate config asks for DeepSpeed, which is not installed; "
                         "`DS_BUILD_OPS=0 pip install 'deepspeed>=0.19'`, or launch with an FSDP config") from None


def fit_deepspeed_to_run(accelerator: Accelerator, micro_batch_size: int, max_grad_norm: float) -> None:
    """The run's options where DeepSpeed would otherwise use its own: the
    micro-batch (Accelerate reads it from a prepared loader only when the
    model is prepared with one) and the clipping norm (DeepSpeed clips at 1.0
    unless told otherwise; 0 turns it off). Set before `prepare`."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    config = plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["train_batch_size"] = micro_batch_size * accelerator.gradient_accumulation_steps * accelerator.num_processes
    config["gradient_clipping"] = float(max_grad_norm or 0.0)
    if plugin.zero_stage == 3:  # the end-of-run model is gathered from the partitions
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True


@contextmanager
def models_built_whole(accelerator: Accelerator):
    """While a ZeRO-3 config is active, transformers builds every model under
    DeepSpeed's zero.Init, which partitions it over the ranks: a collective.
    Inside this, the main process alone can build an empty model (the
    end-of-run writing does)."""
    if zero_stage(accelerator) != 3:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


def end_training(accelerator: Accelerator) -> None:
    """The trackers and the process group end; models built afterwards in
    this process (the sample from the final model) are built whole again."""
    accelerator.end_training()
    if zero_stage(accelerator) == 3:
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


def enable_fsdp_on_cpu(timeout: timedelta) -> None:
    """Make Accelerate build real FSDP2 over gloo on a CPU-only machine.

    `PartialState(cpu=True)` initialises the gloo process group as MULTI_CPU.
    `AcceleratorState` only turns FSDP on for the multi-device kinds, so the
    shared state is presented as MULTI_GPU while the Accelerator is built;
    `restore_cpu_state` puts it back afterwards. Nothing else is patched.
    """
    state = PartialState(cpu=True, timeout=timeout)
    if state.distributed_type == DistributedType.MULTI_CPU:
        state.distributed_type = DistributedType.MULTI_GPU


# --- FSDP2's collectives over gloo ----------------------------------------------------------------
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


def fit_collectives_to_backend(model: torch.nn.Module) -> None:
    """FSDP2 over gloo (CPU): the collectives above, in every FSDP unit."""
    from torch.distributed.fsdp import FSDPModule

    if not torch.distributed.is_initialized() or torch.distributed.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(GlooAllGather())
            module.set_custom_reduce_scatter(GlooReduceScatter())


def restore_cpu_state() -> None:
    state = PartialState()
    if state.distributed_type == DistributedType.MULTI_GPU and not has_accelerator_device():
        state.distributed_type = DistributedType.MULTI_CPU


def keep_freed_memory_in_process() -> None:
    """On CPU every step allocates and frees the same activation and gradient
    buffers. glibc returns large freed blocks to the OS (mmap/munmap, heap
    trimming), so each step page-faults them in again: a fifth of the step time
    of small models. Raising the mmap threshold (to glibc's maximum) keeps them
    in the heap for reuse, as the CUDA caching allocator does on GPUs. The trim
    threshold and two arenas bound what the heaps keep beyond that: with a 1 GiB
    trim threshold and glibc's many per-thread arenas, a GPT-2 124M rank's RSS
    crept up by 0.5 GB over its first 30 steps before levelling off."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl): leave the allocator alone
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold, m_arena_max = -1, -2, -3, -8
    libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES)  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
    libc.mallopt(m_trim_threshold, 256 * 1024 * 1024)
    libc.mallopt(m_top_pad, 64 * 1024 * 1024)
    libc.mallopt(m_arena_max, 2)


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


def check_processes_fit_devices() -> None:
    """One process per GPU: more would share a GPU (and NCCL refuses that)."""
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and local_processes > torch.cuda.device_count():
        raise UsageError(f"{local_processes} processes on this machine but only {torch.cuda.device_count()} GPU(s); "
                         f"pass --num_processes {torch.cuda.device_count()} to accelerate launch (one process per GPU)")


def quiet_other_ranks(accelerator: Accelerator) -> None:
    """Only the main process reports progress and the warnings every rank would
    repeat; other ranks print errors and their own `[rank N]` warnings."""
    if accelerator.is_main_process:
        return
    import warnings

    import datasets
    import transformers

    warnings.filterwarnings("ignore")
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()


def rank_warning(accelerator: Accelerator, message: str) -> None:
    """A warning that holds for this rank only."""
    print(f"[rank {accelerator.process_index}] warning: {message}", file=sys.stderr, flush=True)


def build_accelerator(gradient_accumulation_steps: int, seed: int, log_with: list | None = None,
                      run_dir: Path | None = None, timeout_s: int = 1800) -> Accelerator:
    end_with_launcher()
    timeout = timedelta(seconds=timeout_s)
    check_processes_fit_devices()
    check_fsdp_options_supported_here()
    on_cpu = not has_accelerator_device()
    process_group = InitProcessGroupKwargs(timeout=timeout)
    if deepspeed_requested():
        check_deepspeed_installed()
        find_deepspeed_config()
    if on_cpu:
        keep_freed_memory_in_process()
    if on_cpu and fsdp_requested():
        enable_fsdp_on_cpu(timeout)
    elif on_cpu and deepspeed_requested() and launched_world_size() > 1:
        # DeepSpeed's own process group: without a backend named, Accelerate
        # finds no device and leaves every CPU rank alone.
        process_group = InitProcessGroupKwargs(backend="gloo", timeout=timeout)
    elif on_cpu and launched_world_size() > 1:
        # Without cpu=True, Accelerate leaves every CPU rank alone (NO).
        PartialState(cpu=True, timeout=timeout)
    accelerator = Accelerator(
        # The loop tells Accelerate where each step ends (train.train_step):
        # not from the data loader, which the loop reads a whole step ahead.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=gradient_accumulation_steps,
                                                                sync_with_dataloader=False),
        # We step the LR schedule once per optimizer step ourselves, so the
        # schedule does not depend on the number of processes.
        step_scheduler_with_optimizer=False,
        # Data order depends on (seed, epoch) only: the same on every rank and
        # after a resume.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed),
        log_with=log_with or None,
        kwargs_handlers=[process_group],
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir)) if run_dir else None,
    )
    restore_cpu_state()
    quiet_other_ranks(accelerator)

    if accelerator.num_processes != launched_world_size():
        raise NotDistributed(f"launched {launched_world_size()} processes but Accelerate sees {accelerator.num_processes}: "
                           "the ranks are not training together; refusing to train")
    if fsdp_requested() and accelerator.distributed_type != DistributedType.FSDP:
        raise NotDistributed(f"the accelerate config asks for FSDP but Accelerate chose {accelerator.distributed_type.value}; "
                           "refusing to train unsharded")
    if deepspeed_requested() and accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise NotDistributed(f"the accelerate config asks for DeepSpeed but Accelerate chose "
                           f"{accelerator.distributed_type.value}; refusing to train without it")
    return accelerator


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


@dataclass
class ShardReport:
    total_params: int
    local_params_per_rank: list[int]


def _local_numel(param: torch.Tensor) -> int:
    """Elements of the parameter this rank holds: its FSDP shard, its ZeRO-3 partition, or all."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor.numel()
    return param.to_local().numel() if hasattr(param, "to_local") else param.numel()


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter (a ZeRO-3 parameter's own tensor is empty outside forward and backward)."""
    return getattr(param, "ds_numel", param.numel())


def gather_ints(accelerator: Accelerator, value: int) -> list[int]:
    """One integer from every rank, in rank order."""
    return [int(n) for n in accelerator.gather(torch.tensor([value], dtype=torch.long, device=accelerator.device)).tolist()]


def shard_report(model: torch.nn.Module, accelerator: Accelerator) -> ShardReport:
    """Count this rank's share of the parameters and gather everyone's."""
    params = list(model.parameters())
    total = sum(full_numel(p) for p in params)
    return ShardReport(total_params=total, local_params_per_rank=gather_ints(accelerator, sum(_local_numel(p) for p in params)))


def verify_sharded(model: torch.nn.Module, accelerator: Accelerator) -> ShardReport:
    """Fail loudly when FSDP (or ZeRO-3) was asked for and the parameters are not sharded."""
    report = shard_report(model, accelerator)
    if zero_stage(accelerator) == 3 and accelerator.num_processes > 1:
        check_partition(report, "ZeRO-3 partitions")
    if accelerator.distributed_type != DistributedType.FSDP or accelerator.num_processes == 1:
        return report
    unsharded = [name for name, p in model.named_parameters() if not hasattr(p, "to_local")]
    if unsharded:
        raise NotDistributed(f"FSDP was asked for but {len(unsharded)} parameters are not sharded "
                           f"(first: {unsharded[0]}); refusing to train unsharded")
    check_partition(report, "FSDP shards")
    return report


def check_partition(report: ShardReport, what: str) -> None:
    if sum(report.local_params_per_rank) < report.total_params or max(report.local_params_per_rank) >= report.total_params:
        raise NotDistributed(f"{what} do not partition the model: per-rank {report.local_params_per_rank}, "
                           f"total {report.total_params}; refusing to train unsharded")


def count_fsdp_units(model: torch.nn.Module) -> int:
    """Modules the auto-wrap policy made into FSDP units (each gathers and frees
    its parameters as one), the root included; 0 when not FSDP."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return sum(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def zero_stage(accelerator: Accelerator) -> int | None:
    """DeepSpeed's ZeRO stage (1, 2 or 3), None when not DeepSpeed."""
    plugin = accelerator.state.deepspeed_plugin if accelerator.distributed_type == DistributedType.DEEPSPEED else None
    return int(plugin.zero_stage) if plugin is not None else None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds; a subclass's are its inner tensors' (a QLoRA
    base weight: 4-bit codes and their scales, not numel x its bf16 dtype)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        return sum(held_bytes(getattr(t, name)) for name in inner)
    return t.numel() * t.element_size()


def _tally(tensors) -> dict[str, int]:
    local = [_local(t) for t in tensors]
    return {"elements": sum(t.numel() for t in local), "bytes": sum(held_bytes(t) for t in local)}


def persistent_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
    """Elements and bytes this rank holds in parameters, gradients and
    optimizer state. `optimizer` is the torch optimizer that steps; without
    DeepSpeed, measure right after its step, before the gradients are freed.

    Under DeepSpeed it is the one inside the ZeRO optimizer, which steps one
    group of this rank's fp32 master partitions at a time and frees each
    group's gradient right after: measure any time after the first step. The
    masters count as optimizer state (as the ZeRO paper counts them). The
    gradients are what the stage keeps between backward and step: ZeRO-1
    accumulates them whole in the model's parameters, ZeRO-2/3 only this
    rank's partition (the masters' size, in the model's dtype). A ZeRO-3
    parameter holds only its partition (`ds_tensor`)."""
    params = [getattr(p, "ds_tensor", p) for p in model.parameters()]
    moments = [v for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
    stage = getattr(model, "zero_optimization_stage", lambda: None)()
    if stage is None:
        grads = _tally(p.grad for p in params if p.grad is not None)
        return {"params": _tally(params), "grads": grads, "optimizer": _tally(moments)}
    masters = list(optimizer.state)  # the partitions the inner optimizer stepped, keyed as its state
    trainable = [p for p in model.parameters() if p.requires_grad]
    grad_elements = sum(full_numel(p) for p in trainable) if stage == 1 else sum(m.numel() for m in masters)
    element_size = trainable[0].element_size() if trainable else 0
    grads = {"elements": grad_elements, "bytes": grad_elements * element_size}
    return {"params": _tally(params), "grads": grads, "optimizer": _tally([*moments, *masters])}


def peak_memory_bytes(accelerator: Accelerator, host: "HostMemory") -> int:
    """Peak memory of this rank: device allocator on GPU, resident set on CPU."""
    if accelerator.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(accelerator.device))
    return host.lifetime_peak()


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
        """Start a new phase: returns the resident set now, the base of the phase's rise."""
        self._earlier_peak = self.lifetime_peak()
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass  # not Linux, or not allowed: the phase's peak is then the lifetime's
        return resident_bytes()


def resident_bytes() -> int:
    """This process's resident set now (Linux; 0 where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


class Heartbeats:
    """Each rank touches its file after every optimizer step. A rank whose
    collective timed out names the ranks whose files went quiet: the ones that
    stopped answering (a hung or stopped process, a lost machine)."""

    def __init__(self, run_dir: Path, accelerator: Accelerator, timeout_s: int):
        self.dir = Path(run_dir) / ".heartbeats"
        self.rank, self.world_size, self.timeout_s = accelerator.process_index, accelerator.num_processes, timeout_s

    def beat(self) -> None:
        if self.world_size > 1:
            self.dir.mkdir(exist_ok=True)
            (self.dir / f"rank{self.rank}").touch()

    def lost(self, error: BaseException) -> RankLost:
        now = time.time()
        quiet = [r for r in range(self.world_size) if r != self.rank and now - self._last_beat(r) > self.timeout_s / 2]
        who = f"rank(s) {', '.join(map(str, quiet))}" if quiet else "another rank"
        return RankLost(f"[rank {self.rank}] {who} stopped answering: no collective completed within --ddp_timeout "
                        f"{self.timeout_s} s ({type(error).__name__}); once it is running again, or gone, continue "
                        f"with `finetune resume {self.dir.parent}`")

    def _last_beat(self, rank: int) -> float:
        try:
            return (self.dir / f"rank{rank}").stat().st_mtime
        except OSError:
            return 0.0


def is_collective_timeout(error: BaseException) -> bool:
    """gloo and NCCL say so in their messages; torch wraps them in RuntimeError or DistBackendError."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text)


class WriteFailed(Exception):
    """A write failed on some rank; the message is that rank's reason."""


def weights_from_main_process(accelerator: Accelerator) -> bool:
    """fsdp_cpu_ram_efficient_loading under FSDP2: only the main process reads
    the weights; `prepare` shards the model on the meta device and sends every
    rank its shards from the main process's copy (Accelerate's
    fsdp2_load_full_state_dict). A run holds one full copy, not one per rank."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return (accelerator.distributed_type == DistributedType.FSDP and accelerator.num_processes > 1
            and plugin.fsdp_version == 2 and bool(plugin.cpu_ram_efficient_loading))


def leave_loading_to_the_ranks(accelerator: Accelerator) -> None:
    """Accelerate must not send the main process's copy of the weights: each
    rank reads its own shards once `prepare` has sharded the empty model
    (finetune/shard_loading.py), or (QLoRA) loaded and quantised its own copy."""
    accelerator.state.fsdp_plugin.cpu_ram_efficient_loading = False


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


def check_wrap_policy(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """FSDP2's size-based wrap (fsdp_cnn.yaml, the lectures' policy) would wrap
    any module over the threshold, and fully_shard refuses containers without
    a forward (a transformer's ModuleList of blocks): say so in one line
    before `prepare` fails with a traceback."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    plugin = accelerator.state.fsdp_plugin
    if "size_based" not in str(plugin.auto_wrap_policy).lower():
        return
    containers = [(name, type(module).__name__) for name, module in model.named_modules()
                  if name and type(module).forward is torch.nn.Module.forward
                  and sum(p.numel() for p in module.parameters()) > plugin.min_num_params]
    if containers:
        name, kind = containers[0]
        raise UsageError(f"this accelerate config wraps modules by size, which would make {name} (a {kind} without "
                         f"forward) an FSDP unit, and FSDP2 cannot; launch {type(model).__name__} with "
                         "`--config_file $(finetune configs --path fsdp)` (a unit per transformer block)")


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
