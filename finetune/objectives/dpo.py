"""DPO (`--method dpo`, TRL's names and formulas): the policy's log-ratio of
chosen to rejected against a frozen reference's,
`logits = (pc - pr) - (rc - rr)`, then
- sigmoid: -log sigmoid(beta * logits)             (the DPO paper)
- ipo:     (logits - 1 / (2 beta))^2, on per-token mean log-probs
- hinge:   relu(1 - beta * logits)
The implied rewards are beta * (policy - reference) log-probs."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.errors import UsageError
from finetune.objectives.base import PairObjective, ReferenceOptions, no_reference_model_under_adapters
from finetune.options import option

DPO_LOSSES = ("sigmoid", "ipo", "hinge")  # TRL's names


@dataclass
class DPOOptions:
    """DPO"""
    dpo_loss: str = option("sigmoid", "sigmoid (the DPO paper), ipo (squared, on per-token log-probs) or hinge (TRL's "
                           "names and formulas)", choices=DPO_LOSSES)
    precompute_reference: bool = option(False, "the reference's log-probs of every pair computed in one pass before "
                                        "training and cached with the data (reused by a resume and by later runs on "
                                        "the same pairs and reference); no reference is held while training")


class DPO(PairObjective):
    name = "dpo"
    summary = ("preference pairs against a frozen reference: the starting model, or the base with the adapters off "
               "under LoRA")
    options = DPOOptions
    shared = (*PairObjective.shared, ReferenceOptions)

    def check(self, cfg) -> None:
        super().check(cfg)
        no_reference_model_under_adapters(cfg)
        if cfg.precompute_reference and cfg.task == "image-text-to-text":
            raise UsageError("--precompute_reference caches the log-probs of token pairs, and pairs with images are "
                             "made as they are read; drop it (the reference is then scored with each batch)")

    def holds_reference(self, cfg) -> bool:
        return True

    def pair_losses(self, cfg, policy, reference):
        import torch
        import torch.nn.functional as F

        from finetune.objectives.preference_loss import PairLosses, pair_metrics

        if cfg.dpo_loss == "ipo":
            policy, reference = policy.per_token(), reference.per_token()
        logits = (policy.chosen - policy.rejected) - (reference.chosen - reference.rejected)
        if cfg.dpo_loss == "sigmoid":
            losses = -F.logsigmoid(cfg.dpo_beta * logits)
        elif cfg.dpo_loss == "ipo":
            losses = (logits - 1 / (2 * cfg.dpo_beta)) ** 2
        else:
            losses = torch.relu(1 - cfg.dpo_beta * logits)
        return PairLosses(losses, pair_metrics(policy, cfg.dpo_beta * (policy.chosen - reference.chosen),
                                               cfg.dpo_beta * (policy.rejected - reference.rejected)))


OBJECTIVE = DPO()
