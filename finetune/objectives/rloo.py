"""RLOO (`--method rloo`, TRL's RLOOTrainer: names, formulas and defaults):
GRPO's rollouts, each completion's advantage its reward minus the mean reward
of the other completions of its prompt (the leave-one-out baseline). The KL to
the reference (`--beta`, 0.05 by default) is taken from the reward: beta times
the sum over the completion of the sampling policy's minus the reference's
log-probs. The loss is one clipped term a completion on the ratio of the whole
sequence, averaged over completions; `--importance_sampling_level sequence`
takes GSPO's ratio instead, the exp of the mean of its tokens' log-ratios."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.objectives.base import RolloutObjective
from finetune.options import option


@dataclass
class RLOOOptions:
    """RLOO"""
    normalize_advantages: bool = option(False, "divide the advantages by their std over the batch (after "
                                        "subtracting their mean)")


class RLOO(RolloutObjective):
    name = "rloo"
    summary = ("online RL as grpo, against the leave-one-out baseline (the mean reward of the prompt's other "
               "completions), the KL to the reference taken from the reward")
    options = RLOOOptions
    defaults = {"num_generations": 2, "beta": 0.05}  # TRL's RLOOConfig
    takes_kl_from_reward = True

    def advantages(self, cfg, per_function, weights, penalty=None):
        from finetune.objectives import grpo_loss

        return grpo_loss.leave_one_out_advantages(per_function, weights, cfg.num_generations, penalty,
                                                  cfg.normalize_advantages)

    def token_losses(self, cfg, logps, old_logps, advantages, mask, reference_logps, importance=None):
        from finetune.objectives import grpo_loss

        return grpo_loss.sequence_losses(logps, old_logps, advantages, mask, cfg.epsilon,
                                         cfg.epsilon_high or cfg.epsilon, cfg.importance_sampling_level == "sequence",
                                         importance)

    def loss_count(self, cfg, mask) -> float:
        return float(len(mask))  # completions

    def reduced(self, cfg, losses, mask):
        return losses.sum(), float(len(losses))


OBJECTIVE = RLOO()
