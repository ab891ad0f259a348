"""The optimizer and the learning-rate schedule of a run."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler, StepLR
from transformers import get_scheduler

from finetune.config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with decay on matrices and embeddings only (nanoGPT's rule), or
    the lectures' Adam with L2 decay on every parameter. Both fused: one kernel
    for all parameters instead of about ten ops per parameter, which matters
    most for sharded (DTensor) parameters, where each op is dispatched in Python.
    Frozen parameters (the base under adapters) get no optimizer state."""
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.optimizer == "adam":
        return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate, betas=betas,
                                weight_decay=cfg.weight_decay, fused=True)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    # No empty group (adapters are all matrices): ZeRO's engine drops one, and the schedule would then count one too many.
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
              if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas, fused=True)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> LRScheduler:
    """transformers' schedules count optimizer steps; the lectures' StepLR (step_size=1) counts epochs."""
    if cfg.lr_scheduler_type == "step":
        return StepLR(optimizer, step_size=1, gamma=cfg.lr_gamma)
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total_steps)
    specific = {"min_lr_rate": cfg.min_lr_ratio} if cfg.lr_scheduler_type == "cosine_with_min_lr" else {}
    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                         scheduler_specific_kwargs=specific)


class LRSchedule:
    """The learning rate over a run. The loop reports every optimizer step and
    every finished epoch; the scheduler moves on the unit it counts."""

    def __init__(self, scheduler, optimizer: torch.optim.Optimizer, counts: str):
        self.scheduler = scheduler  # as prepared by Accelerate: saved and restored with checkpoints
        self.optimizer = optimizer
        self.counts = counts        # "step" or "epoch"

    @classmethod
    def for_config(cls, scheduler, optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> "LRSchedule":
        return cls(scheduler, optimizer, "epoch" if cfg.lr_scheduler_type == "step" else "step")

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.optimizer.param_groups[0]["lr"]

    def step_done(self) -> None:
        if self.counts == "step":
            self.scheduler.step()

    def epoch_done(self) -> None:
        if self.counts == "epoch":
            self.scheduler.step()

    def follow_new_length(self, step: int) -> str | None:
        """After a resume that changed the run's length: the optimizer still holds
        the learning rate the old schedule gave; take the new schedule's value at
        this step now (not one step late), and say what changed."""
        torch_scheduler = getattr(self.scheduler, "scheduler", self.scheduler)
        if self.counts != "step" or not hasattr(torch_scheduler, "lr_lambdas"):
            return None
        old = self.lr
        for group, base, factor in zip(self.optimizer.param_groups, torch_scheduler.base_lrs,
                                       torch_scheduler.lr_lambdas):
            group["lr"] = base * factor(step)
        return (f"the learning-rate schedule now spans the new length: the learning rate of step {step + 1} is "
                f"{self.lr:.3e} (it was {old:.3e} on the old length)")

    def rescale_peak(self, learning_rate: float) -> str | None:
        """A checkpoint restores the schedule of the old peak learning rate; a
        resume that passes another --learning_rate scales what is left of the
        schedule to the new peak."""
        torch_scheduler = getattr(self.scheduler, "scheduler", self.scheduler)
        old = torch_scheduler.base_lrs[0]
        if math.isclose(old, learning_rate, rel_tol=1e-12):
            return None
        ratio = learning_rate / old
        torch_scheduler.base_lrs = [lr * ratio for lr in torch_scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] *= ratio
            group["initial_lr"] *= ratio
        return f"learning rate schedule rescaled from a peak of {old:g} to {learning_rate:g}"
