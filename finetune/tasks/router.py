"""The routers of a mixture-of-experts model during training: how many tokens
each expert of each layer receives (logged as expert load), and with
`--output_router_logits` the family's own load-balancing loss, times
`--router_aux_loss_coef`, added to the loss.

Both come from forward hooks on the router modules (models/moe.py), which
return (logits [tokens, experts], scores, expert indices). The model's own
`output_router_logits` would compute the loss with the attention mask it was
given, and a packed batch's is [B, 1, T, T]: the hooks take the logits, and the
loss gets the [B, T] mask of real tokens, as the family's function expects.
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from finetune.errors import UsageError
from finetune.models import moe
from finetune.signals import NoSignal

AUX_LOSS = "aux_loss"
EXPERT_TOKENS = "expert_tokens"  # a step metric of shape [layers, experts]: tokens routed to each expert
# Below this normalised entropy of a layer's expert load (1 = every expert as busy) for COLLAPSE_STEPS steps, warn.
COLLAPSED_ENTROPY = 0.5
COLLAPSE_STEPS = 5


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside the wrappers (DDP, peft, torch.compile)."""
    from transformers import PreTrainedModel

    return next(m for m in model.modules() if isinstance(m, PreTrainedModel))


@dataclass
class Routing:
    """What the routers did in one forward."""
    logits: list[torch.Tensor] = field(default_factory=list)  # per layer [tokens, experts]
    counts: list[torch.Tensor] = field(default_factory=list)  # per layer [experts]: tokens sent to each


class Routers:
    """A MoE model's routers, watched during the training forwards."""

    def __init__(self, model: torch.nn.Module, output_router_logits: bool, coefficient: float):
        inner = hf_model(model)
        config = inner.config
        self.num_experts, self.top_k = moe.expert_count(config), moe.experts_per_token(config)
        self.adds_loss = output_router_logits
        self.coefficient = coefficient if coefficient >= 0 else float(getattr(config, "router_aux_loss_coef", 0.001))
        self.loss_function = getattr(sys.modules[type(inner).__module__], "load_balancing_loss_func", None)
        if output_router_logits and self.loss_function is None:
            raise UsageError(f"--output_router_logits: {type(inner).__name__} has no load-balancing loss in "
                             "transformers; drop --output_router_logits and --router_aux_loss_coef")
        self.modules = list(moe.routers(inner).values())
        self.totals = torch.zeros(len(self.modules), self.num_experts, dtype=torch.float64)

    @classmethod
    def of(cls, model: torch.nn.Module, cfg) -> "Routers | None":
        """The routers of a MoE model; None for a dense one, where the router options are refused."""
        config = hf_model(model).config
        if not moe.is_moe(config):
            if cfg.output_router_logits:
                raise UsageError(f"--output_router_logits applies to mixture-of-experts models, and --model "
                                 f"{cfg.model} is dense ({config.model_type}, no experts); drop "
                                 "--output_router_logits and --router_aux_loss_coef")
            return None
        return cls(model, cfg.output_router_logits, cfg.router_aux_loss_coef)

    @property
    def step_metrics(self) -> tuple[str, ...]:
        return ((AUX_LOSS,) if self.adds_loss else ()) + (EXPERT_TOKENS,)

    @contextmanager
    def watching(self, mask: torch.Tensor | None):
        """Hooks on every router for one forward; `mask` [B, T]: the real tokens."""
        routing = Routing()
        flat_mask = mask.reshape(-1).bool() if mask is not None else None

        def record(module, args, output):
            if not isinstance(output, tuple) or len(output) < 3:
                return
            logits, indices = output[0], output[-1]
            if self.adds_loss:
                routing.logits.append(logits)
            chosen = indices.detach()
            if flat_mask is not None and len(chosen) == len(flat_mask):
                chosen = chosen[flat_mask]
            routing.counts.append(torch.bincount(chosen.reshape(-1), minlength=self.num_experts).float())
        handles = [router.register_forward_hook(record) for router in self.modules]
        try:
            yield routing
        finally:
            for handle in handles:
                handle.remove()

    def terms(self, routing: Routing, mask: torch.Tensor | None, targets: int) -> tuple[torch.Tensor | None, dict]:
        """(what the loss gains, summed like it over the micro-batch's `targets`; the step metrics' sums)."""
        metrics = {}
        device = routing.counts[0].device if routing.counts else None
        counts = (torch.stack(routing.counts) if len(routing.counts) == len(self.modules)
                  else torch.zeros(len(self.modules), self.num_experts, device=device))
        metrics[EXPERT_TOKENS] = counts
        if not self.adds_loss:
            return None, metrics
        aux = self.loss_function(tuple(routing.logits), self.num_experts, self.top_k, mask)
        metrics[AUX_LOSS] = aux.detach().float() * targets
        return self.coefficient * aux * targets, metrics

    def step_means(self, sums: dict, count: float) -> dict:
        """The logged metrics from a step's sums: aux_loss over the targets,
        and each layer's expert load (its busiest and idlest experts' shares of
        the tokens it routed, and its normalised entropy, 1 when even)."""
        means = {}
        if AUX_LOSS in sums:
            means[AUX_LOSS] = sums[AUX_LOSS] / max(count, 1)
        counts = torch.tensor(sums[EXPERT_TOKENS], dtype=torch.float64).view(len(self.modules), self.num_experts)
        self.totals += counts
        means.update(load_metrics(counts))
        return means

    def summary(self) -> dict:
        return {"router_aux_loss_coef": self.coefficient if self.adds_loss else None,
                "expert_load": {"experts": self.num_experts, "experts_per_token": self.top_k,
                                "tokens_routed": int(self.totals[0].sum() / max(self.top_k, 1)) if len(self.totals) else 0,
                                "per_layer": load_per_layer(self.totals)}}

    def no_signal_checks(self) -> list[NoSignal]:
        return [NoSignal("expert_load_entropy", lambda v: v < COLLAPSED_ENTROPY, COLLAPSE_STEPS,
                         "a router sends most of its tokens to a few experts (expert_load/layer_N/ in metrics.jsonl "
                         "says which layer); the load-balancing loss counters that: add --output_router_logits, and "
                         "raise --router_aux_loss_coef if it is on")]


def load_per_layer(counts: torch.Tensor) -> list[dict]:
    """Each layer's share of routed tokens for its idlest and busiest expert, and the normalised entropy."""
    rows = []
    for layer in counts:
        total = float(layer.sum())
        if total == 0:
            rows.append({"min": 0.0, "max": 0.0, "entropy": 0.0})
            continue
        share = layer / total
        entropy = float(-(share[share > 0] * share[share > 0].log()).sum()) / math.log(len(layer))
        rows.append({"min": float(share.min()), "max": float(share.max()), "entropy": entropy})
    return rows


def load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """A step's expert load: the extremes over the layers, then each layer's own."""
    per_layer = load_per_layer(counts)
    if not per_layer:
        return {}
    out = {"expert_load_min": min(r["min"] for r in per_layer), "expert_load_max": max(r["max"] for r in per_layer),
           "expert_load_entropy": min(r["entropy"] for r in per_layer)}
    for i, row in enumerate(per_layer):
        out.update({f"expert_load/layer_{i}/{key}": value for key, value in row.items()})
    return out
