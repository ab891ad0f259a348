"""Supervised fine-tuning (`--method sft`, the default): each task's own loss,
the next tokens of text or the answers of chat and instruction data for a
causal LM, the classes of an image classifier. Its own options are the
mixture-of-experts router's."""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.errors import UsageError
from finetune.objectives.base import Objective
from finetune.options import option


@dataclass
class RouterOptions:
    """mixture of experts"""
    output_router_logits: bool = option(False, "add the family's own load-balancing loss of the routers to the loss, "
                                        "times --router_aux_loss_coef (logged as aux_loss)")
    router_aux_loss_coef: float = option(-1.0, "the load-balancing loss's coefficient (negative: the model config's "
                                         "own, 0.001 for Qwen3-MoE, Mixtral and gpt-oss)")


class SFT(Objective):
    name = "sft"
    summary = "the text's next tokens, or the answers of chat/instruction data"
    options = RouterOptions
    tasks = ("causal-lm", "image-classification", "image-text-to-text")
    reads_mixtures = True

    def check(self, cfg) -> None:
        if cfg.output_router_logits and cfg.task != "causal-lm":
            raise UsageError(f"--output_router_logits applies to mixture-of-experts language models, not --task "
                             f"{cfg.task}; drop it")
        if not math.isfinite(cfg.router_aux_loss_coef):
            raise UsageError(f"--router_aux_loss_coef must be a number, got {cfg.router_aux_loss_coef}; pass e.g. "
                             "0.001")
        if cfg.router_aux_loss_coef >= 0 and not cfg.output_router_logits:
            raise UsageError(f"--router_aux_loss_coef {cfg.router_aux_loss_coef:g} weighs the routers' load-balancing "
                             "loss, which only --output_router_logits adds; add --output_router_logits")


OBJECTIVE = SFT()
