"""What a launch asks for, read from the environment `accelerate launch` sets
from its config: the number of processes, FSDP and its version, the device
mesh; and what of it this machine cannot run. Light on purpose: every training
rank checks it before transformers and datasets load (finetune/preflight.py),
importing torch alone (about 2 CPU-s of a rank's 6) to ask for devices. The
backends and PEFT methods run the same checks where their libraries load;
backends/mesh.py checks the mesh against the backend."""

from __future__ import annotations

import importlib.util
import os

from finetune.models.attention import WITHOUT_MASK as ATTN_WITHOUT_MASK
from finetune.errors import UsageError

ENV_PREFIX = "PARALLELISM_CONFIG_"  # what `accelerate launch` sets from the config's parallelism_config keys
QLORA_ON_CPU = "FINETUNE_QLORA_ON_CPU"  # "1": run QLoRA's code path on CPU, to test it where no GPU is


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def fsdp_requested() -> bool:
    """True when the accelerate config (via `accelerate launch`) asks for FSDP."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def deepspeed_requested() -> bool:
    """True when the accelerate config asks for DeepSpeed."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def fsdp_version() -> int:
    return 1 if os.environ.get("FSDP_VERSION", "2") == "1" else 2


def has_accelerator_device() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def check_fsdp_runs_here() -> None:
    """FSDP1 and parameter offload need an accelerator device (measured: FSDP1
    rejects `cpu:0`, FSDP2's CPUOffloadPolicy needs a device to offload from)."""
    if not fsdp_requested() or has_accelerator_device():
        return
    if fsdp_version() == 1:
        raise UsageError("fsdp_version: 1 (FSDP1) needs a GPU and this machine has none; "
                         "launch with `--config_file $(finetune configs --path fsdp)` (FSDP2), which runs on CPU")
    if os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
        raise UsageError("fsdp_offload_params: true (CPU offload) needs a GPU to offload from and this machine has none; "
                         "launch with `--config_file $(finetune configs --path fsdp)`")


def check_qlora_runs_here(num_processes: int, under_fsdp2: bool) -> None:
    """QLoRA's 4-bit base: on a CUDA GPU, and sharded by FSDP2 alone."""
    import torch

    if not torch.cuda.is_available() and os.environ.get(QLORA_ON_CPU) != "1":
        raise UsageError("--peft qlora holds the base in 4 bits, which needs a CUDA GPU; on this machine use "
                         "--peft lora")
    if num_processes > 1 and not under_fsdp2:
        raise UsageError("--peft qlora shards its 4-bit base with FSDP2 only; launch with "
                         "accelerate_configs/fsdp.yaml, or on one process")


def check_attention_trains_here(attn_implementation: str) -> None:
    """The kernels that keep packed examples apart without a mask train on GPUs
    only: torch has no flex-attention backward on a CPU, and flash-attention is
    CUDA code."""
    import torch

    if attn_implementation in ATTN_WITHOUT_MASK and not torch.cuda.is_available():
        raise UsageError(f"--attn_implementation {attn_implementation} trains on CUDA GPUs only (torch "
                         f"{torch.__version__.split('+')[0]} has no {attn_implementation} backward on this machine); "
                         "pass --attn_implementation sdpa, which keeps packed examples apart with a mask")
    if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise UsageError("--attn_implementation flash_attention_2 needs the flash-attn package: pip install flash-attn "
                         "--no-build-isolation, or pass --attn_implementation flex_attention")


def check_liger_runs_here() -> None:
    """Liger's kernels are Triton code: CUDA GPUs, with the liger extra."""
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--use_liger_kernel runs Triton kernels, which need a CUDA GPU; drop it on this machine (the "
                         "chunked loss already keeps the logits small)")
    if importlib.util.find_spec("liger_kernel") is None:
        raise UsageError("--use_liger_kernel needs the liger-kernel package: pip install 'finetune[liger]'")


def check_launch_runs_here(peft: str, attn_implementation: str = "auto", use_liger_kernel: bool = False) -> None:
    """The launch's processes against the mesh, then what needs a device this machine lacks."""
    check_mesh_size(launched_world_size())
    check_fsdp_runs_here()
    if peft == "qlora":
        check_qlora_runs_here(launched_world_size(), fsdp_requested() and fsdp_version() == 2)
    check_attention_trains_here(attn_implementation)
    if use_liger_kernel:
        check_liger_runs_here()


def requested_mesh() -> dict[str, int] | None:
    """The sizes the launch asks for (accelerate's names without the prefix:
    dp_replicate_size, dp_shard_size, tp_size, cp_size, sp_size); None when it
    sets no parallelism_config."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return None
    sizes = {}
    for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
        value = os.environ.get(ENV_PREFIX + name.upper(), "1")
        if not value.isdigit() or int(value) < 1:
            raise UsageError(f"parallelism_config_{name}: {value!r} is not a positive number of ranks; "
                             "set it in the accelerate config or with --parallelism_config_" + name)
        sizes[name] = int(value)
    return sizes


def check_mesh_size(world_size: int) -> None:
    """A mesh whose sizes do not multiply to the number of ranks launched."""
    sizes = requested_mesh()
    if sizes is None:
        return
    product = sizes["dp_replicate_size"] * sizes["dp_shard_size"] * sizes["tp_size"]
    if product != world_size:
        raise UsageError(f"the parallelism_config mesh is dp_replicate {sizes['dp_replicate_size']} x dp_shard "
                         f"{sizes['dp_shard_size']} x tp {sizes['tp_size']} = {product} ranks, but {world_size} "
                         f"were launched; make the sizes multiply to --num_processes (or launch {product})")


def no_deepspeed_engine() -> None:
    """Accelerate's unwrap (in `prepare`, at every save, and in
    save_pretrained) imports DeepSpeed whenever it is installed, only to compare
    the model with DeepSpeed's engine: 1.1-1.8 s and 66 MB per process
    (measured), and a warning on stdout. A process without that engine (a
    run on another backend, export, generate, evaluate) tells Accelerate so."""
    import accelerate.utils.other

    accelerate.utils.other.is_deepspeed_available = lambda: False
