"""`--peft qlora`: LoRA on a 4-bit base, the adapted layers' base weights
held as torchao's NF4Tensor (the QLoRA paper's 4-bit NormalFloat with double
quantisation) rather than bitsandbytes' Params4bit: it is a tensor subclass
FSDP2 shards and all-gathers in its 4-bit form (fsdp_pre/post_all_gather),
works on any device, and dequantises inside F.linear. bitsandbytes' 4-bit
parameters are not DTensor-aware; Accelerate leaves them out of sharding.

Every rank loads the base and quantises its own copy; the final model and the
export merge the adapters into the base reloaded whole, not into the 4 bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from finetune.errors import UsageError
from finetune.launch_request import check_qlora_runs_here, launched_world_size
from finetune.model_dir import Weights
from finetune.peft.lora import ADAPTER_NAME, LoRA, adapted_layers, merged_into, require_peft, resolve_targets

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel

NF4_BLOCK = 64           # weights per absmax scale
NF4_SCALER_BLOCK = 256   # scales per second-level scale (double quantisation)
# 4-bit codes, an int8 scale per block and an fp32 scale per NF4_SCALER_BLOCK scales
NF4_BYTES_PER_WEIGHT = (4 + 8 / NF4_BLOCK + 32 / (NF4_BLOCK * NF4_SCALER_BLOCK)) / 8


def nf4_tensor_class():
    """torchao's NF4Tensor, or one line saying how to install it."""
    try:
        try:
            from torchao.quantization import NF4Tensor
        except ImportError:  # older torchao kept it with its dtypes
            from torchao.dtypes import NF4Tensor
    except ImportError:
        raise UsageError("--peft qlora needs torchao for its 4-bit weights: pip install 'finetune[qlora]' "
                         "(or pip install torchao)") from None
    return NF4Tensor


def linears_for_conv1d(model: torch.nn.Module) -> int:
    """GPT-2's Conv1D layers (y = x W + b, W stored [in, out]) as nn.Linear with
    W transposed: the same function, in the layout NF4 multiplies. peft's
    adapters have the same shapes either way; only the saved config's
    fan_in_fan_out differs, which peft sets itself when merging into Conv1D."""
    from transformers.pytorch_utils import Conv1D

    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                linear = torch.nn.Linear(child.nx, child.nf, device="meta")
                linear.weight = torch.nn.Parameter(child.weight.detach().t().contiguous(), child.weight.requires_grad)
                linear.bias = child.bias
                setattr(module, name, linear)
                swapped += 1
    return swapped


def quantize_adapted_bases(model: torch.nn.Module, world_size: int, device: torch.device) -> tuple[int, list[str]]:
    """Each adapted layer's frozen base weight as NF4, quantised on `device`.
    NF4 keeps one scale per NF4_BLOCK weights and one second-level scale per
    NF4_SCALER_BLOCK scales, and FSDP splits its rows evenly over the ranks, so
    a weight whose shard is not whole second-level blocks stays as it was.
    Returns how many were quantised and the names of the layers kept."""
    nf4 = nf4_tensor_class()
    quantized, kept = 0, []
    for name, layer in adapted_layers(model).items():
        weight = layer.weight
        if not nf4_fits(weight.shape, world_size):
            kept.append(name)
            continue
        four_bit = nf4.from_tensor(weight.detach().to(device), NF4_BLOCK, NF4_SCALER_BLOCK)
        layer.weight = torch.nn.Parameter(four_bit, requires_grad=False)
        quantized += 1
    return quantized, kept


def nf4_fits(shape: torch.Size, world_size: int) -> bool:
    """A 2-D weight whose rows split evenly over the ranks into whole second-level blocks."""
    return (len(shape) == 2 and shape[0] % world_size == 0
            and shape.numel() % (NF4_BLOCK * NF4_SCALER_BLOCK * world_size) == 0)


def keep_4_bit_layers_out_of_fsdp(model: torch.nn.Module, accelerator: "Accelerator") -> None:
    """On one rank FSDP2 skips its all-gather and rebuilds each weight from the
    first of its all-gather inputs alone, and NF4 has three. One rank has
    nothing to shard: FSDP leaves the 4-bit layers out and manages the rest.
    Their frozen biases go where FSDP would have put them, in the dtype it
    would have cast them to."""
    layers = [layer for layer in adapted_layers(model).values() if isinstance(layer.weight, nf4_tensor_class())]
    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
    for layer in layers:
        if layer.bias is not None:  # FSDP would have moved it to the device, and cast it
            layer.bias.data = layer.bias.data.to(accelerator.device, compute_dtype or layer.bias.dtype)
    accelerator.state.fsdp_plugin.ignored_modules = layers


class QLoRA(LoRA):
    name = "qlora"
    extra = "qlora"
    each_rank_loads_the_base = True  # 4-bit weights are made where the weights are
    four_bit_bytes_per_weight = NF4_BYTES_PER_WEIGHT

    def check_supported_here(self) -> None:
        check_qlora_runs_here(launched_world_size(), under_fsdp2=True)  # the launch's backend: check_backend
        require_peft(self.name)
        nf4_tensor_class()

    def check_backend(self, accelerator: "Accelerator") -> None:
        check_qlora_runs_here(accelerator.num_processes, accelerator.is_fsdp2)

    def adapt_base(self, model: "PreTrainedModel") -> "PreTrainedModel":
        """GPT-2's Conv1D layers as Linear, the layout NF4 multiplies; nothing
        adapted in place (fused experts, routers), which NF4 does not hold."""
        linears_for_conv1d(model)
        targets = resolve_targets(model, self.config())
        if targets.parameters:
            raise UsageError(f"--peft qlora holds the adapted linear layers in 4 bits, and --lora_target_modules "
                             f"{self.cfg.lora_target_modules} also takes in {', '.join(targets.parameters)} (fused "
                             "experts or routers), which it cannot quantise; use --peft lora, or name linear layers "
                             f"alone: --lora_target_modules {','.join(targets.modules) or 'q_proj,v_proj'}")
        return model

    def wrap(self, model: "PreTrainedModel", source: str, accelerator: "Accelerator",
             record_base: bool) -> "PreTrainedModel":
        self.check_backend(accelerator)
        model = super().wrap(model, source, accelerator, record_base)
        quantized, kept = quantize_adapted_bases(model, accelerator.num_processes, accelerator.device)
        if accelerator.is_fsdp2 and accelerator.num_processes == 1:
            keep_4_bit_layers_out_of_fsdp(model, accelerator)
        accelerator.print(f"4-bit (NF4) base weights in {quantized} of {quantized + len(kept)} adapted layers"
                          + (f"; {len(kept)} keep --model_dtype, their shards not being whole blocks of "
                             f"{NF4_BLOCK * NF4_SCALER_BLOCK} weights (first: {kept[0]})" if kept else ""))
        return model

    def final_weights(self, specs: dict[str, tuple[torch.Size, torch.dtype]], fetch: Callable,
                      model: torch.nn.Module, base: Callable[[], "PreTrainedModel"]) -> Weights:
        """The adapters merged into the weights the base was quantised from,
        reloaded whole (once, on the main process), as `finetune export` merges them."""
        adapters = [name for name in specs if ".lora_" in name]
        return merged_into(base(), fetch(adapters), model.peft_config[ADAPTER_NAME])

    def plan_model(self, model: torch.nn.Module, num_processes: int) -> tuple[torch.nn.Module, int]:
        model, _ = super().plan_model(model, num_processes)
        four_bit = sum(layer.weight.numel() for layer in adapted_layers(model).values()
                       if nf4_fits(layer.weight.shape, num_processes))
        return model, four_bit
