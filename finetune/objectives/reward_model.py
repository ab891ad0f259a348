"""Reward models (`--method reward`, TRL's RewardTrainer: names, formula and
defaults): the language model's body under a one-score head
(AutoModelForSequenceClassification, `--task sequence-classification`),
trained on preference pairs so that the chosen answer scores above the
rejected one:

    -log sigmoid(r_chosen - r_rejected - margin) + c * (r_chosen + r_rejected)^2

with a pair's `margin` column when the data has one (else 0) and c
`--center_rewards_coefficient` (0: off). Its held-out metric is the share of
pairs ranked right. The trained model scores text for `--reward_funcs`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from finetune.errors import UsageError
from finetune.objectives.base import Objective, PromptOptions
from finetune.options import option
from finetune.presets import GPT2_PRESETS


@dataclass
class RewardOptions:
    """reward model"""
    center_rewards_coefficient: float = option(0.0, "weight of the mean squared sum of a pair's rewards, which keeps "
                                               "them centred on 0 (0: off; TRL's name, the paper that proposes it "
                                               "uses 0.01)")


class Reward(Objective):
    name = "reward"
    summary = ("a reward model: a one-score head on the model, trained on preference pairs to score the chosen "
               "answer above the rejected one")
    task_class = "finetune.objectives.scored_pairs:RewardModel"
    data_format = "preference"
    options = RewardOptions
    shared = (PromptOptions,)
    tasks = ("sequence-classification",)
    defaults = {"task": "sequence-classification"}
    learning_rates = {"full": 1e-4, "lora": 1e-4}  # TRL's RewardConfig default
    sequences_per_row = 2
    metrics: ClassVar[tuple[str, ...]] = ("accuracy", "margin", "mean_reward")  # TRL's names

    def check(self, cfg) -> None:
        if cfg.model in GPT2_PRESETS:
            raise UsageError(f"--method reward puts a score head on a pretrained language model, and --model "
                             f"{cfg.model} is a preset built from scratch; pass a model dir or Hub id (an SFT run's "
                             "final/, for instance)")
        value = cfg.center_rewards_coefficient
        if not (value >= 0 and math.isfinite(value)):
            raise UsageError(f"--center_rewards_coefficient must be >= 0, got {value}; pass 0 (off) or e.g. 0.01")

    def pair_rewards_losses(self, cfg, chosen, rejected, margin):
        """[P] rewards of each pair's chosen and rejected sequence, [P] margins
        (0 without a margin column): the [P] losses and the [P] metric terms."""
        import torch.nn.functional as F

        losses = -F.logsigmoid(chosen - rejected - margin)
        if cfg.center_rewards_coefficient:
            losses = losses + cfg.center_rewards_coefficient * (chosen + rejected) ** 2
        chosen, rejected = chosen.detach(), rejected.detach()
        return losses, {"accuracy": (chosen > rejected).to(chosen.dtype), "margin": chosen - rejected,
                        "mean_reward": (chosen + rejected) / 2}


OBJECTIVE = Reward()
