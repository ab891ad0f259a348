"""ORPO (`--method orpo`, TRL's formula and names): no reference. The SFT
loss of the chosen sequence (its token mean over the micro-batch, prompt
included, as TRL computes it) minus lambda times log sigmoid of the log
odds ratio of chosen to rejected, on per-token mean log-probs p:

    log_odds = (pc - pr) - (log(1 - exp pc) - log(1 - exp pr))

`--dpo_beta` is lambda (TRL's `beta`, 0.1 by default); the rewards are
lambda times the mean log-probs."""

from __future__ import annotations

from finetune.objectives.base import PairObjective


class ORPO(PairObjective):
    name = "orpo"
    summary = "preference pairs, no reference: the chosen answer's SFT loss plus an odds-ratio term"
    reads_chosen_sequence = True
    metrics = (*PairObjective.metrics, "nll_loss", "log_odds_ratio", "log_odds_chosen")

    def pair_losses(self, cfg, policy, reference):
        import torch.nn.functional as F

        from finetune.objectives.preference_loss import PairLosses, pair_metrics

        mean = policy.per_token()
        chosen, rejected = mean.chosen.float(), mean.rejected.float()
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        nll = policy.chosen_sequence_nll.sum() / policy.chosen_sequence_tokens.sum().clamp(min=1)
        losses = nll - cfg.dpo_beta * ratio  # the micro-batch's token-mean NLL, once a pair
        metrics = pair_metrics(mean, cfg.dpo_beta * chosen, cfg.dpo_beta * rejected)
        metrics.update({"nll_loss": nll.detach().expand_as(ratio), "log_odds_ratio": ratio.detach(),
                        "log_odds_chosen": log_odds.detach()})
        return PairLosses(losses, metrics)


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2."""
    import torch

    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


OBJECTIVE = ORPO()
