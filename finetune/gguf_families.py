"""The model families GGUF export converts, by transformers' model_type: for
each, llama.cpp's architecture name, its hyperparameter keys, how a tensor is
stored there (rotary rows, norms, fused experts) and what the architecture
fixes. The writer is gguf_export.py; the model card reads the table's keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


Piece = tuple[str, tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]  # (HF-style name, shape, from the tensor)


def _whole(name: str, shape: tuple[int, ...], config) -> list[Piece]:
    return [(name, shape, lambda t: t)]


@dataclass(frozen=True)
class Family:
    arch: str                                        # llama.cpp's architecture name
    write_hyperparameters: Callable                  # (writer, config) -> None
    reorder: Callable[[str, torch.Tensor, object], torch.Tensor]  # (HF name, tensor, config) -> as llama.cpp stores it
    writes_tied_output: bool = False                 # a tied output matrix written out (llama.cpp's GPT-2 wants one)
    rope_scalings: tuple[str, ...] = ()              # the rotary scalings llama.cpp runs for it, besides none
    # An HF tensor as the tensors llama.cpp stores for it (fused experts: several), by a name the gguf map knows.
    pieces: Callable[[str, tuple[int, ...], object], list[Piece]] = _whole
    # What llama.cpp's architecture fixes that a config may set otherwise: (what, the config's, what it runs).
    fixed: Callable[[object], list[tuple[str, object, object]]] = lambda config: []


def _heads(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def _rope_parameters(config) -> dict:
    """The rotary parameters of the full-attention layers (Gemma 3 keeps one set per layer type)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return parameters.get("full_attention", parameters)


def _rope_theta(config) -> float:
    return float(_rope_parameters(config).get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def rope_type(config) -> str:
    parameters = _rope_parameters(config)
    return parameters.get("rope_type", parameters.get("type", "default")) or "default"


def _decoder_hyperparameters(writer, config) -> None:
    """What every decoder family states, and what a mixture of experts, a
    sliding window, an explicit head size or YaRN adds."""
    from finetune.models import moe

    heads, kv_heads, head_dim = _heads(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "head_dim", None):  # a head size that is not hidden / heads (Qwen3, Gemma 3, gpt-oss)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if moe.is_moe(config):
        writer.add_expert_count(moe.expert_count(config))
        writer.add_expert_used_count(moe.experts_per_token(config))
        writer.add_expert_feed_forward_length(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
    parameters = _rope_parameters(config)
    if rope_type(config) == "yarn":
        writer.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(parameters["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(parameters["original_max_position_embeddings"]))


def _gemma3_hyperparameters(writer, config) -> None:
    """Gemma 3's local layers rotate with their own base and see a sliding window."""
    _decoder_hyperparameters(writer, config)
    local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention", {})
    if (base := local.get("rope_theta") or getattr(config, "rope_local_base_freq", None)) is not None:
        writer.add_rope_freq_base_swa(float(base))
    writer.add_sliding_window(config.sliding_window)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _phi3_hyperparameters(writer, config) -> None:
    _decoder_hyperparameters(writer, config)
    writer.add_rope_scaling_orig_ctx_len(int(getattr(config, "original_max_position_embeddings", None)
                                             or config.max_position_embeddings))
    writer.add_sliding_window(getattr(config, "sliding_window", None) or 0)  # 0: Phi-3 (llama.cpp's Phi-4 test)


def _gpt_oss_hyperparameters(writer, config) -> None:
    _decoder_hyperparameters(writer, config)
    writer.add_sliding_window(config.sliding_window)


def _gpt2_hyperparameters(writer, config) -> None:
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_vocab_size(config.vocab_size)


def _llama_rotary_rows(name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    """llama.cpp's `llama` rotates interleaved pairs (x0, x1), (x2, x3)...;
    transformers rotates halves (x0, x_d/2)...: each head's q and k rows are
    reordered from halves to pairs."""
    if not name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                          "self_attn.q_proj.bias", "self_attn.k_proj.bias")):
        return tensor
    heads, kv_heads, _ = _heads(config)
    n = heads if ".q_proj." in name else kv_heads
    return (tensor.reshape(n, 2, tensor.shape[0] // n // 2, *tensor.shape[1:])
            .transpose(1, 2).reshape(tensor.shape))


def llama3_rope_factors(config) -> torch.Tensor:
    """Llama 3.1's rotary scaling as llama.cpp reads it (a `rope_freqs` vector:
    each frequency is divided by its factor): long wavelengths slowed by
    `factor`, short ones kept, those between blended, as transformers' llama3 rope."""
    p = config.rope_parameters
    _, _, head_dim = _heads(config)
    frequencies = 1.0 / p["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelength = 2 * math.pi / frequencies
    context, low, high, factor = (p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"],
                                  p["factor"])
    smooth = (context / wavelength - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelength < context / high, 1.0, torch.where(wavelength > context / low, factor, blended))
    return factors.to(torch.float32)


def _as_stored(name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    return tensor


def _gemma_norms(name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    """Gemma's RMSNorm multiplies by 1 + w; llama.cpp's by what is stored."""
    return tensor + 1.0 if name.endswith("norm.weight") else tensor


def _fused_experts(name: str, shape: tuple[int, ...], config) -> list[Piece]:
    """gate_up_proj [experts, 2 x ff, hidden] as its gate half and its up half
    (Qwen3-MoE, Mixtral, OLMoE); down_proj [experts, hidden, ff] as it is."""
    if name.endswith(".experts.gate_up_proj"):
        experts, double, hidden = shape
        ff = double // 2
        stem = name.removesuffix(".gate_up_proj")
        return [(f"{stem}.gate_proj.weight", (experts, ff, hidden), lambda t: t[:, :ff]),
                (f"{stem}.up_proj.weight", (experts, ff, hidden), lambda t: t[:, ff:])]
    if name.endswith(".experts.down_proj"):
        return [(f"{name}.weight", shape, lambda t: t)]
    return [(name, shape, lambda t: t)]


def _gpt_oss_experts(name: str, shape: tuple[int, ...], config) -> list[Piece]:
    """gpt-oss keeps its experts as [experts, in, out], gate and up interleaved
    column by column (gate first), with biases; llama.cpp wants [experts, out,
    in] stacks. The attention sinks are a weight there."""
    if name.endswith(".experts.gate_up_proj"):
        experts, hidden, double = shape
        stem = name.removesuffix(".gate_up_proj")
        return [(f"{stem}.gate_proj.weight", (experts, double // 2, hidden), lambda t: t[..., ::2].transpose(1, 2)),
                (f"{stem}.up_proj.weight", (experts, double // 2, hidden), lambda t: t[..., 1::2].transpose(1, 2))]
    if name.endswith(".experts.gate_up_proj_bias"):
        experts, double = shape
        stem = name.removesuffix(".gate_up_proj_bias")
        return [(f"{stem}.gate_proj.bias", (experts, double // 2), lambda t: t[..., ::2]),
                (f"{stem}.up_proj.bias", (experts, double // 2), lambda t: t[..., 1::2])]
    if name.endswith(".experts.down_proj"):
        experts, ff, hidden = shape
        return [(f"{name}.weight", (experts, hidden, ff), lambda t: t.transpose(1, 2))]
    if name.endswith(".experts.down_proj_bias"):
        return [(name.replace("down_proj_bias", "down_proj.bias"), shape, lambda t: t)]
    if name.endswith(".self_attn.sinks"):
        return [(f"{name}.weight", shape, lambda t: t)]
    return [(name, shape, lambda t: t)]


CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _gpt2_linear_rows(name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    """GPT-2's Conv1D keeps (in, out); llama.cpp's matrices are (out, in)."""
    if name.endswith(CONV1D_WEIGHTS):
        return tensor.t().contiguous()
    return tensor


def _qwen3_moe_fixed(config) -> list[tuple[str, object, object]]:
    return [("norm_topk_prob", getattr(config, "norm_topk_prob", True), True)]


def _gemma3_fixed(config) -> list[tuple[str, object, object]]:
    """llama.cpp scales Gemma 3's attention by the head size (27B: hidden / heads), not by query_pre_attn_scalar."""
    heads, _, head_dim = _heads(config)
    runs = config.hidden_size // heads if config.query_pre_attn_scalar == config.hidden_size // heads else head_dim
    return [("query_pre_attn_scalar", config.query_pre_attn_scalar, runs)]


def _olmoe_fixed(config) -> list[tuple[str, object, object]]:
    """llama.cpp's OLMoE normalises keys over every head: no grouped-query attention."""
    heads, kv_heads, _ = _heads(config)
    return [("num_key_value_heads", kv_heads, heads)]


# By transformers' model_type. The architecture names and tensor names are the gguf package's tables.
FAMILIES = {
    "llama": Family("llama", _decoder_hyperparameters, _llama_rotary_rows, rope_scalings=("llama3",)),
    "mistral": Family("llama", _decoder_hyperparameters, _llama_rotary_rows),
    "mixtral": Family("llama", _decoder_hyperparameters, _llama_rotary_rows, pieces=_fused_experts),
    "qwen2": Family("qwen2", _decoder_hyperparameters, _as_stored),
    "qwen3": Family("qwen3", _decoder_hyperparameters, _as_stored),
    "qwen3_moe": Family("qwen3moe", _decoder_hyperparameters, _as_stored, pieces=_fused_experts,
                        fixed=_qwen3_moe_fixed),
    "gemma3_text": Family("gemma3", _gemma3_hyperparameters, _gemma_norms, fixed=_gemma3_fixed),
    "phi3": Family("phi3", _phi3_hyperparameters, _as_stored),
    "olmoe": Family("olmoe", _decoder_hyperparameters, _as_stored, pieces=_fused_experts, fixed=_olmoe_fixed),
    "gpt_oss": Family("gpt-oss", _gpt_oss_hyperparameters, _as_stored, rope_scalings=("yarn",),
                      pieces=_gpt_oss_experts),
    "gpt2": Family("gpt2", _gpt2_hyperparameters, _gpt2_linear_rows, writes_tied_output=True),
}
FAMILY_NAMES = ("Llama (and SmolLM2), Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3, Phi-3, OLMoE, gpt-oss "
                "and GPT-2")

# Buffers some checkpoints carry that are not weights (recomputed by every runtime).
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
