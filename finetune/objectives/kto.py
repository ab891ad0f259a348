"""KTO (`--method kto`, TRL's names, formulas and defaults): unpaired
completions, each labelled desirable or not (data/unpaired.py), against a
frozen reference as DPO's. With r = beta * (policy - reference) summed
log-probs of a completion and z the KL estimate (the micro-batch's mean of
policy minus reference log-probs of mismatched prompt/completion rows, over
every rank, at least 0, no gradient):

    desirable:   desirable_weight   * (1 - sigmoid(r - beta z))
    undesirable: undesirable_weight * (1 - sigmoid(beta z - r))

and the loss is their mean over the completions. `--kto_loss
apo_zero_unpaired` drops z: 1 - sigmoid(r) and sigmoid(r)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from finetune.errors import UsageError
from finetune.objectives.base import (BetaOptions, Objective, PromptOptions, ReferenceOptions,
                                      no_reference_model_under_adapters, positive)
from finetune.options import option

KTO_LOSSES = ("kto", "apo_zero_unpaired")  # TRL's names


@dataclass
class KTOOptions:
    """KTO"""
    desirable_weight: float = option(1.0, "the weight of the desirable completions' losses (TRL's advice: make "
                                     "desirable_weight x desirable count to undesirable_weight x undesirable count "
                                     "between 1 and 4/3)")
    undesirable_weight: float = option(1.0, "the weight of the undesirable completions' losses")
    kto_loss: str = option("kto", "kto (the KTO paper, with the KL estimate from mismatched rows) or "
                           "apo_zero_unpaired (no KL term; TRL's names)", choices=KTO_LOSSES)


class KTO(Objective):
    name = "kto"
    summary = ("unpaired completions labelled desirable or not (prompt/completion/label), against a frozen "
               "reference as for dpo")
    task_class = "finetune.objectives.unpaired:UnpairedLM"
    data_format = "unpaired"
    options = KTOOptions
    shared = (PromptOptions, BetaOptions, ReferenceOptions)
    learning_rates = {"full": 1e-6, "lora": 5e-6}  # TRL's KTOConfig rate, and DPO's under LoRA
    sequences_per_row = 2  # each row, and its mismatched row for the KL estimate (no gradient)
    metrics: ClassVar[tuple[str, ...]] = ("kl", "rewards/chosen", "logps/chosen", "rewards/rejected",
                                          "logps/rejected", "rewards/margins")  # TRL's names

    def check(self, cfg) -> None:
        positive(cfg, "dpo_beta", "desirable_weight", "undesirable_weight")
        if cfg.kto_loss == "kto" and cfg.per_device_batch_size < 2:
            raise UsageError(f"--per_device_batch_size {cfg.per_device_batch_size}: KTO's KL estimate pairs each "
                             "prompt with another row's completion of the same micro-batch; pass 2 or more (or "
                             "--kto_loss apo_zero_unpaired, which has no KL term)")
        if not all(math.isfinite(getattr(cfg, n)) for n in ("desirable_weight", "undesirable_weight")):
            raise UsageError("--desirable_weight and --undesirable_weight must be finite numbers; pass e.g. 1.0")
        no_reference_model_under_adapters(cfg)

    def holds_reference(self, cfg) -> bool:
        return True

    def uses_kl(self, cfg) -> bool:
        return cfg.kto_loss == "kto"

    def unpaired_losses(self, cfg, policy, reference, desirable, kl):
        """[N] summed completion log-probs under the policy and the reference,
        [N] bool labels, the KL estimate (a scalar tensor): the [N] weighted
        losses, and per row the terms the metrics sum (0 in the other class's)."""
        import torch

        rewards = cfg.dpo_beta * (policy - reference)
        shift = cfg.dpo_beta * kl if cfg.kto_loss == "kto" else torch.zeros_like(kl)
        losses = torch.where(desirable, cfg.desirable_weight * (1 - torch.sigmoid(rewards - shift)),
                             cfg.undesirable_weight * (1 - torch.sigmoid(shift - rewards)))
        rewards, logps = rewards.detach(), policy.detach()
        chosen = desirable.to(logps.dtype)
        terms = {"kl": kl.detach().expand_as(logps), "rewards/chosen": rewards * chosen,
                 "logps/chosen": logps * chosen, "rewards/rejected": rewards * (1 - chosen),
                 "logps/rejected": logps * (1 - chosen), "desirable": chosen, "undesirable": 1 - chosen}
        return losses, terms

    @staticmethod
    def means(sums: dict[str, float], count: float) -> dict[str, float]:
        """The step's or the evaluation's metrics from the sums of `unpaired_losses`'s
        terms over `count` rows (TRL's: each class's mean)."""
        chosen, rejected = sums.pop("desirable"), sums.pop("undesirable")
        means = {"kl": sums["kl"] / max(count, 1)}
        for side, n in (("chosen", chosen), ("rejected", rejected)):
            if n:
                means[f"rewards/{side}"] = sums[f"rewards/{side}"] / n
                means[f"logps/{side}"] = sums[f"logps/{side}"] / n
        if chosen and rejected:
            means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
        return means


OBJECTIVE = KTO()
