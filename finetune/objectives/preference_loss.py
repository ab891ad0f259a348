"""What a preference objective's loss takes and gives (dpo.py, simpo.py,
orpo.py, ...): the summed log-probs of each pair's completions, and one loss a
pair with its metrics under TRL's names."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PairLogps:
    """Summed log-probs of each pair's chosen and rejected completion, and their token counts."""
    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    # The NLL of each whole chosen sequence (prompt included) and its predicted
    # tokens, where the objective reads it (`reads_chosen_sequence`: ORPO's SFT term).
    chosen_sequence_nll: torch.Tensor | None = None
    chosen_sequence_tokens: torch.Tensor | None = None

    def per_token(self) -> "PairLogps":
        return PairLogps(self.chosen / self.chosen_tokens, self.rejected / self.rejected_tokens,
                         self.chosen_tokens, self.rejected_tokens)


@dataclass
class PairLosses:
    losses: torch.Tensor   # [pairs], differentiable
    metrics: dict[str, torch.Tensor]  # name -> [pairs], detached


def pair_metrics(policy: PairLogps, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict:
    """TRL's rewards/* and logps/* of each pair."""
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
            "rewards/margins": chosen_rewards - rejected_rewards,
            "logps/chosen": policy.chosen.detach(), "logps/rejected": policy.rejected.detach()}
