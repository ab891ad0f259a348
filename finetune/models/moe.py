"""What a mixture-of-experts model is made of, read from its config and its
module tree: how many experts, how many each token uses, which parameters are
the experts' and which modules route tokens to them.

Transformers 5 stores a layer's experts as fused 3-D parameters of one
`experts` module (`gate_up_proj` [experts, ., .], `down_proj`), beside a router
module (`gate` in Qwen3-MoE, Mixtral and OLMoE, `router` in gpt-oss) whose
forward returns (router logits [tokens, experts], scores, expert indices).
Nothing here knows about training.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config-only questions here stay light: the preflight asks them before torch loads
    import torch

EXPERTS_MODULE = "experts"
# The config names families give their expert count and their experts per token.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk")


def _text_config(config):
    if isinstance(config, dict):  # a config.json read as it is
        config = config.get("text_config") or config
        return type("Config", (), config)
    return getattr(config, "text_config", None) or config


def expert_count(config) -> int:
    """Experts per MoE layer; 0 for a dense model."""
    config = _text_config(config)
    return next((int(v) for key in EXPERT_COUNT_KEYS if isinstance(v := getattr(config, key, None), int) and v > 1), 0)


def experts_per_token(config) -> int:
    config = _text_config(config)
    return next((int(v) for key in EXPERTS_PER_TOKEN_KEYS if isinstance(v := getattr(config, key, None), int)), 0)


def is_moe(config) -> bool:
    return expert_count(config) > 0


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape, also where ZeRO-3 holds an empty placeholder for it (its `ds_shape`)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def is_expert_parameter(name: str) -> bool:
    """A parameter of a layer's experts (fused, or one expert's own linear layer)."""
    return f".{EXPERTS_MODULE}." in f".{name}"


def fused_expert_parameters(model: torch.nn.Module) -> list[str]:
    """The names of the 3-D parameters that hold every expert of a layer at once."""
    return [name for name, p in model.named_parameters() if len(full_shape(p)) == 3 and is_expert_parameter(name)]


def routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Each MoE layer's router by its name: the module beside `experts` whose
    weight scores each token against each expert ([experts, hidden])."""
    import torch

    found = {}
    for block_name, block in model.named_modules():
        experts = getattr(block, EXPERTS_MODULE, None)
        if not isinstance(experts, torch.nn.Module):
            continue
        count = getattr(experts, "num_experts", None)
        if count is None and isinstance(experts, torch.nn.ModuleList):
            count = len(experts)
        for child_name, child in block.named_children():
            weight = getattr(child, "weight", None)
            shape = full_shape(weight) if isinstance(weight, torch.Tensor) else ()
            if child_name != EXPERTS_MODULE and len(shape) == 2 and (count is None or shape[0] == count):
                found[f"{block_name}.{child_name}" if block_name else child_name] = child
    return found


def parameter_counts(model: torch.nn.Module, config) -> dict[str, int]:
    """total, expert (the experts' share) and active (what one token computes
    with: everything but the experts, plus experts_per_token of each layer's experts)."""
    total = sum(math.prod(full_shape(p)) for p in model.parameters())
    experts = sum(math.prod(full_shape(p)) for name, p in model.named_parameters() if is_expert_parameter(name))
    count, per_token = expert_count(config), experts_per_token(config)
    active = total - experts + (experts * per_token // count if count else experts)
    return {"total": total, "experts": experts, "active": active}
