"""Preference losses on the log-probs of each pair's completions (TRL's
formulas and metric names).

DPO compares the policy's log-ratio of chosen to rejected with a frozen
reference's: `logits = (pc - pr) - (rc - rr)`, then
- sigmoid: -log sigmoid(beta * logits)             (the DPO paper)
- ipo:     (logits - 1 / (2 beta))^2, on per-token mean log-probs
- hinge:   relu(1 - beta * logits)
and the implied rewards are beta * (policy - reference) log-probs.

SimPO needs no reference: on per-token mean log-probs,
-log sigmoid(beta * (pc - pr) - gamma); its rewards are beta * the policy's
mean log-probs. It shares DPO's data and forward, and shows that a method
need not have a reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from finetune.config import TrainConfig

# Per-pair values whose batch means are logged, under TRL's names.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass
class PairLogps:
    """Summed log-probs of each pair's chosen and rejected completion, and their token counts."""
    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def per_token(self) -> "PairLogps":
        return PairLogps(self.chosen / self.chosen_tokens, self.rejected / self.rejected_tokens,
                         self.chosen_tokens, self.rejected_tokens)


@dataclass
class PairLosses:
    losses: torch.Tensor   # [pairs], differentiable
    metrics: dict[str, torch.Tensor]  # name -> [pairs], detached


class PreferenceLoss:
    name: str
    needs_reference: bool
    per_token: bool  # on per-token mean log-probs instead of sums

    def __call__(self, policy: PairLogps, reference: PairLogps | None) -> PairLosses:
        raise NotImplementedError

    @staticmethod
    def _metrics(policy: PairLogps, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict:
        chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
        return {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
                "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
                "rewards/margins": chosen_rewards - rejected_rewards,
                "logps/chosen": policy.chosen.detach(), "logps/rejected": policy.rejected.detach()}


class DPOLoss(PreferenceLoss):
    name = "dpo"
    needs_reference = True

    def __init__(self, beta: float, kind: str):
        self.beta, self.kind = beta, kind
        self.per_token = kind == "ipo"

    def __call__(self, policy: PairLogps, reference: PairLogps | None) -> PairLosses:
        assert reference is not None
        if self.per_token:
            policy, reference = policy.per_token(), reference.per_token()
        logits = (policy.chosen - policy.rejected) - (reference.chosen - reference.rejected)
        if self.kind == "sigmoid":
            losses = -F.logsigmoid(self.beta * logits)
        elif self.kind == "ipo":
            losses = (logits - 1 / (2 * self.beta)) ** 2
        else:
            losses = torch.relu(1 - self.beta * logits)
        return PairLosses(losses, self._metrics(policy, self.beta * (policy.chosen - reference.chosen),
                                                self.beta * (policy.rejected - reference.rejected)))


class SimPOLoss(PreferenceLoss):
    name = "simpo"
    needs_reference = False
    per_token = True

    def __init__(self, beta: float, gamma: float):
        self.beta, self.gamma = beta, gamma

    def __call__(self, policy: PairLogps, reference: PairLogps | None = None) -> PairLosses:
        policy = policy.per_token()
        losses = -F.logsigmoid(self.beta * (policy.chosen - policy.rejected) - self.gamma)
        return PairLosses(losses, self._metrics(policy, self.beta * policy.chosen, self.beta * policy.rejected))


def preference_loss(cfg: TrainConfig) -> PreferenceLoss:
    if cfg.method == "dpo":
        return DPOLoss(cfg.dpo_beta, cfg.dpo_loss)
    if cfg.method == "simpo":
        return SimPOLoss(cfg.dpo_beta, cfg.simpo_gamma)
    raise ValueError(f"{cfg.method} is not a preference method")
