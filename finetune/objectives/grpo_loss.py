"""GRPO's arithmetic (TRL's formulas and names), on tensors alone.

For each prompt, a group of G completions is sampled and scored. A
completion's advantage is its reward minus its group's mean, divided by the
group's std (`scale_rewards=group`), the batch's (`batch`) or not (`none`).
Each completion token then has the clipped policy-gradient loss

    r = exp(logp - logp_old)
    loss_t = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) [+ beta * kl_t]
    kl_t = exp(ref - logp) - (ref - logp) - 1       (the k3 estimator)

where logp_old is the sampling policy's (equal to logp, detached, when each
batch of samples trains one step: r = 1). GSPO (`level="sequence"`) takes for
every token of a completion the ratio of the sequence, exp of the mean of its
tokens' log-ratios. The loss types differ only in how
the token losses are averaged; `reduced` returns the sum and the count the
training loop divides it by over the whole global batch:

    dapo     every completion token of the global batch
    grpo     each completion's mean, then over completions
    dr_grpo  completions x max_completion_length
    bnpo     each micro-batch's tokens, then over micro-batches
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

STD_EPSILON = 1e-4  # TRL's: advantages of a group with one reward stay finite


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased std ignoring NaNs (TRL's nanstd)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    std = torch.sqrt(variance * count / (count - 1))
    return std.squeeze(dim) if dim is not None else std.reshape(())


@dataclass
class Advantages:
    rewards: torch.Tensor       # [N] the weighted sum of the functions' rewards (NaN: no function applied)
    advantages: torch.Tensor    # [N]
    std_is_zero: torch.Tensor   # [N] bool: the completion's group (or the batch) had one reward


def group_advantages(per_function: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str) -> Advantages:
    """`per_function`: [N, F] rewards (NaN where a function returned None), N
    completions in groups of `num_generations` consecutive rows."""
    unscorable = torch.isnan(per_function).all(dim=1)
    rewards = (per_function * weights.to(per_function).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:  # "none" still reports which groups had one reward
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    return Advantages(rewards, torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std)))


@dataclass
class TokenLosses:
    losses: torch.Tensor                 # [B, T] per completion token, 0 elsewhere
    kl: torch.Tensor | None              # [B, T] or None without a reference
    low_clipped: torch.Tensor            # [B, T] bool: r < 1 - eps_low where A < 0
    high_clipped: torch.Tensor           # [B, T] bool: r > 1 + eps_high where A > 0


def token_losses(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor,
                 epsilon_low: float, epsilon_high: float, beta: float = 0.0,
                 reference_logps: torch.Tensor | None = None, level: str = "token",
                 importance: torch.Tensor | None = None) -> TokenLosses:
    """`logps`, `old_logps`, `reference_logps`: [B, T] log-probs of the
    completion tokens (anything where `mask` is False); `advantages`: [B].
    `level` sequence (GSPO): every token of a completion has the ratio
    exp(mean of its tokens' log-ratios), clipped as one. `importance` ([B, T]
    or [B, 1], None: 1) weighs the policy term, not the KL (TRL's order)."""
    old_logps = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old_logps
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1).expand_as(logps)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    advantage = advantages.unsqueeze(1)
    losses = -torch.min(ratio * advantage, clipped * advantage)
    if importance is not None:
        losses = losses * importance
    kl = None
    if beta:
        delta = reference_logps - logps
        kl = torch.exp(delta) - delta - 1
        losses = losses + beta * kl
    mask = mask.bool()
    return TokenLosses(losses * mask, kl * mask if kl is not None else None,
                       (ratio < 1 - epsilon_low) & (advantage < 0) & mask,
                       (ratio > 1 + epsilon_high) & (advantage > 0) & mask)


def reduced(losses: torch.Tensor, mask: torch.Tensor, loss_type: str,
            max_completion_length: int) -> tuple[torch.Tensor, float]:
    """(sum, count) of one micro-batch: the loss of a step is the sum over its
    global batch divided by the count over it."""
    tokens = mask.sum()
    if loss_type == "dapo":
        return losses.sum(), float(tokens)
    if loss_type == "grpo":
        return (losses.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum(), float(len(losses))
    if loss_type == "dr_grpo":
        return losses.sum() / max_completion_length, float(len(losses))
    if loss_type == "bnpo":
        return losses.sum() / tokens.clamp(min=1), 1.0
    raise ValueError(f"unknown loss type {loss_type}")


def loss_count(mask: torch.Tensor, loss_type: str) -> float:
    """`reduced`'s count, known before the forward."""
    return {"dapo": float(mask.sum()), "bnpo": 1.0}.get(loss_type, float(len(mask)))


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """[B, T]: the entropy of each position's next-token distribution."""
    logps = torch.log_softmax(logits.float(), dim=-1)
    return -(logps.exp() * logps).sum(dim=-1)


def leave_one_out_advantages(per_function: torch.Tensor, weights: torch.Tensor, num_generations: int,
                             penalty: torch.Tensor | None, normalize: bool) -> Advantages:
    """RLOO's (TRL's RLOOTrainer): each completion's reward (minus `penalty`,
    beta times its summed KL to the reference) against the mean of the other
    scored completions of its group; unscorable completions and groups with a
    single scored one get 0. `normalize`: then over the batch, (A - mean) / (std + 1e-4)."""
    unscorable = torch.isnan(per_function).all(dim=1)
    rewards = (per_function * weights.to(per_function).unsqueeze(0)).nansum(dim=1)
    if penalty is not None:
        rewards = rewards - penalty.to(rewards)
    rewards[unscorable] = torch.nan
    groups = rewards.view(-1, num_generations)
    scored = (~torch.isnan(groups)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(groups, dim=1, keepdim=True) - groups) / (scored - 1)
    advantages = (groups - baselines).view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + STD_EPSILON)
    std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    return Advantages(rewards, torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std)))


def sequence_losses(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor,
                    mask: torch.Tensor, epsilon_low: float, epsilon_high: float, normalized: bool,
                    importance: torch.Tensor | None = None) -> TokenLosses:
    """RLOO's loss (TRL's RLOOTrainer): one clipped term a completion, on the
    ratio of the whole sequence, exp(sum of its tokens' log-ratios), or with
    `normalized` (GSPO) of their mean; spread over its tokens, so that their sum
    is the completion's loss."""
    old_logps = logps.detach() if old_logps is None else old_logps
    tokens = mask.sum(-1).clamp(min=1)
    log_ratio = ((logps - old_logps) * mask).sum(-1)
    ratio = torch.exp(log_ratio / tokens if normalized else log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    losses = -torch.min(ratio * advantages, clipped * advantages)
    mask = mask.bool()
    low = ((ratio < 1 - epsilon_low) & (advantages < 0)).unsqueeze(1) & mask
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).unsqueeze(1) & mask
    spread = (losses / tokens).unsqueeze(1)
    if importance is not None:
        spread = spread * importance
    return TokenLosses(spread * mask, None, low, high)


def engine_importance(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                      clip_min: float, clip_max: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's vLLM importance-sampling correction: the ratio of the trainer's
    probability of each sampled token to the engine's ([B, T] for token_*
    modes, [B, 1] the completion's product for sequence_*), clipped to
    [clip_min, clip_max] (_truncate) or 0 outside them (_mask); a bound of 0 is
    none. Also the ratio's min, mean and max and the log-prob differences'
    mean and max over the completion tokens (TRL's sampling/ metrics), as
    tensors for the caller to reduce over ranks."""
    mask = mask.bool()
    diff = (trainer_logps - engine_logps).masked_fill(~mask, 0.0)
    sequence = mode.startswith("sequence")
    ratio = torch.exp(diff.sum(-1, keepdim=True) if sequence else diff)
    low, high = (clip_min or None), (clip_max or None)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=low, max=high)
    else:
        outside = (ratio < (low or -math.inf)) | (ratio > (high or math.inf))
        ratio = ratio.masked_fill(outside, 0.0)
    kept = ratio.flatten() if sequence else ratio[mask]
    delta = diff.abs()[mask]
    zero = diff.new_zeros(())
    return ratio, {"importance_sampling_ratio/min": kept.min() if kept.numel() else zero,
                   "importance_sampling_ratio/mean": kept.mean() if kept.numel() else zero,
                   "importance_sampling_ratio/max": kept.max() if kept.numel() else zero,
                   "sampling_logp_difference/mean": delta.mean() if delta.numel() else zero,
                   "sampling_logp_difference/max": delta.max() if delta.numel() else zero}
