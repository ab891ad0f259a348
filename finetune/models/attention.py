"""The attention kernel a causal LM trains with, by transformers' names.

Packed rows hold several examples, which must not attend to each other.
`sdpa` and `eager` are told so by a dense [B, 1, T, T] mask (exact on every
model and device, T^2 memory per row). `flex_attention` and `flash_attention_2`
are told by the position ids alone: transformers builds a document mask for
flex attention (a `BlockMask`, no dense tensor) and variable-length sequences
for flash-attention wherever the position ids restart (the ids each packed
example starts at 0 with; padding is a one-token example of its own)."""

from __future__ import annotations

import importlib.util

from finetune.errors import UsageError

# transformers' names; auto picks the fastest the device and model have
IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flex_attention", "flash_attention_2")
WITHOUT_MASK = ("flex_attention", "flash_attention_2")  # packed examples kept apart by position ids alone


def candidates(requested: str, rows_hold_examples: bool) -> tuple[str, ...]:
    """What to try, fastest first. Rows that hold several examples (or
    padding) on CUDA: flash-attention where it is installed, then flex
    attention, which need no mask. Plain text blocks (one causal sequence a
    row) take sdpa's own causal kernels, and so does a CPU (no flex-attention
    backward there)."""
    import torch

    if requested != "auto":
        return (requested,)
    if not torch.cuda.is_available() or not rows_hold_examples:
        return ("sdpa",)
    flash = ("flash_attention_2",) if importlib.util.find_spec("flash_attn") is not None else ()
    return (*flash, "flex_attention", "sdpa")


def use_attention(model, requested: str, rows_hold_examples: bool = True) -> str:
    """Sets the model's attention kernel; the one chosen. A kernel asked for by
    name that the model's family lacks is one line; `auto` moves on to the
    next, and keeps the family's own when it has none of them."""
    tried = candidates(requested, rows_hold_examples)
    for name in tried:
        try:
            model.set_attn_implementation(name)
            return name
        except (ValueError, ImportError) as e:
            if requested != "auto":
                reason = str(e).strip().splitlines()[0].split(". ")[0]
                raise UsageError(f"--attn_implementation {name}: {type(model).__name__} cannot use it ({reason}); "
                                 "pass --attn_implementation sdpa (or auto)") from None
    return model.config._attn_implementation  # auto, and the family has none of them: its own


def describe(name: str) -> str:
    return f"{name} attention" + (" (packed examples apart by position ids, no mask)" if name in WITHOUT_MASK else "")


def use_liger_kernels(model) -> None:
    """Liger's RMSNorm, SwiGLU and rotary kernels on the model's own modules
    (its fused linear cross-entropy stays off: the loss is finetune's chunked
    one, computed from the output layer's input the same way)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    model_type = model.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise UsageError(f"--use_liger_kernel: Liger has no kernels for {model_type} models (it covers "
                         f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)[:8])}, ...); drop the option")
    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False, cross_entropy=False,
                                    rms_norm=True, swiglu=True, rope=True)
