"""GRPO (`--method grpo`, TRL's names, formulas and defaults): a completion's
advantage is its reward minus its group's mean, divided by the group's std
(`--scale_rewards group`), the batch's, or not; each token then has PPO's
clipped loss, reduced by `--loss_type` (grpo_loss.py). With
`--importance_sampling_level sequence` the ratio is the sequence's (GSPO)."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.objectives.base import RolloutObjective
from finetune.options import option

GRPO_LOSSES = ("grpo", "dapo", "dr_grpo", "bnpo")  # TRL's names and formulas
SCALE_REWARDS = ("group", "batch", "none")  # TRL's: the std the advantages are divided by


@dataclass
class GRPOOptions:
    """GRPO"""
    loss_type: str = option("dapo", "how the per-token losses are averaged: dapo (over every completion token of the "
                            "global batch; TRL's default), grpo (per completion, then over completions), dr_grpo (over "
                            "completions x --max_completion_length), bnpo (over each micro-batch's tokens)",
                            choices=GRPO_LOSSES)
    scale_rewards: str = option("group", "divide the advantages by the std of the group's rewards, of the batch's, "
                                "or none (Dr. GRPO)", choices=SCALE_REWARDS)


class GRPO(RolloutObjective):
    name = "grpo"
    summary = "online RL: the model's own samples of each prompt, scored by --reward_funcs, against their group's mean"
    options = GRPOOptions

    def advantages(self, cfg, per_function, weights, penalty=None):
        from finetune.objectives import grpo_loss

        return grpo_loss.group_advantages(per_function, weights, cfg.num_generations, cfg.scale_rewards)

    def token_losses(self, cfg, logps, old_logps, advantages, mask, reference_logps, importance=None):
        from finetune.objectives import grpo_loss

        return grpo_loss.token_losses(logps, old_logps, advantages, mask, cfg.epsilon, cfg.epsilon_high or cfg.epsilon,
                                      cfg.beta, reference_logps, cfg.importance_sampling_level, importance)

    def loss_count(self, cfg, mask) -> float:
        from finetune.objectives import grpo_loss

        return grpo_loss.loss_count(mask, cfg.loss_type)

    def reduced(self, cfg, losses, mask):
        from finetune.objectives import grpo_loss

        return grpo_loss.reduced(losses, mask, cfg.loss_type, cfg.max_completion_length)


OBJECTIVE = GRPO()
