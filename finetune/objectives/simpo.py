"""SimPO (`--method simpo`, TRL's formula): no reference. On per-token mean
log-probs, -log sigmoid(beta * (pc - pr) - gamma); its rewards are beta times
the policy's mean log-probs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.errors import UsageError
from finetune.objectives.base import PairObjective
from finetune.options import option


@dataclass
class SimPOOptions:
    """SimPO"""
    simpo_gamma: float = option(0.5, "the reward margin the chosen completion should win by")


class SimPO(PairObjective):
    name = "simpo"
    summary = "preference pairs, no reference: length-normalised log-probs and a target margin"
    options = SimPOOptions

    def check(self, cfg) -> None:
        super().check(cfg)
        if not math.isfinite(cfg.simpo_gamma):
            raise UsageError(f"--simpo_gamma must be a number, got {cfg.simpo_gamma}; pass e.g. 0.5")

    def pair_losses(self, cfg, policy, reference):
        import torch.nn.functional as F

        from finetune.objectives.preference_loss import PairLosses, pair_metrics

        policy = policy.per_token()
        losses = -F.logsigmoid(cfg.dpo_beta * (policy.chosen - policy.rejected) - cfg.simpo_gamma)
        return PairLosses(losses, pair_metrics(policy, cfg.dpo_beta * policy.chosen, cfg.dpo_beta * policy.rejected))


OBJECTIVE = SimPO()
