"""Unit tests of the learning-rate schedules."""

from __future__ import annotations

import pytest
import torch

from finetune.config import LR_SCHEDULERS, load_config
from finetune.optim import LRSchedule, build_scheduler


@pytest.mark.parametrize("name", [n for n in LR_SCHEDULERS if n != "step"])
def test_every_schedule_is_transformers_own_with_the_run_s_warmup(name):
    from transformers import get_scheduler

    total, ratio = 40, 0.1
    cfg = load_config(None, {"model": "some/pretrained-model", "lr_scheduler_type": name, "warmup_ratio": ratio,
                             "min_lr_ratio": 0.2, "learning_rate": 0.01})
    ours_opt, theirs_opt = (torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01) for _ in range(2))
    schedule = LRSchedule.for_config(build_scheduler(ours_opt, cfg, total), ours_opt, cfg)
    specific = {"min_lr_rate": 0.2} if name == "cosine_with_min_lr" else {}
    theirs = get_scheduler(name, theirs_opt, num_warmup_steps=4, num_training_steps=total,  # 10% of 40 steps
                           scheduler_specific_kwargs=specific)
    ours_lrs, their_lrs = [], []
    for _ in range(total):
        ours_lrs.append(schedule.lr)
        their_lrs.append(theirs_opt.param_groups[0]["lr"])
        ours_opt.step(), theirs_opt.step()
        schedule.step_done()
        theirs.step()
        schedule.epoch_done()  # per-step schedules ignore epochs
    assert ours_lrs == their_lrs
    assert len(set(ours_lrs)) == 1 if name == "constant" else len(set(ours_lrs)) > 3


def test_a_longer_resumed_run_takes_the_new_schedule_from_its_next_step():
    cfg = load_config(None, {"model": "some/pretrained-model"})  # linear, 3% warmup

    def schedule(total: int) -> LRSchedule:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
        return LRSchedule.for_config(build_scheduler(optimizer, cfg, total), optimizer, cfg)

    def run(s: LRSchedule, steps: int) -> None:
        for _ in range(steps):
            s.optimizer.step()
            s.step_done()

    old, longer = schedule(30), schedule(40)
    run(old, 20)
    run(longer, 20)
    resumed = schedule(40)  # a resume with --max_steps 40 of a 30-step run stopped at step 20
    resumed.scheduler.load_state_dict(old.scheduler.state_dict())
    resumed.optimizer.load_state_dict(old.optimizer.state_dict())
    assert resumed.lr == old.lr != longer.lr
    note = resumed.follow_new_length(20)
    assert resumed.lr == pytest.approx(longer.lr) and f"{longer.lr:.3e}" in note and f"{old.lr:.3e}" in note
    run(resumed, 5)
    run(longer, 5)
    assert resumed.lr == pytest.approx(longer.lr)


def test_the_lectures_step_schedule_halves_once_per_epoch():
    cfg = load_config(None, {"task": "image-classification"})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
    schedule = LRSchedule.for_config(build_scheduler(optimizer, cfg, 100), optimizer, cfg)
    lrs = []
    for epoch in range(3):
        for _ in range(5):
            lrs.append(schedule.lr)
            optimizer.step()
            schedule.step_done()
        schedule.epoch_done()
    assert lrs == [1e-2] * 5 + [5e-3] * 5 + [2.5e-3] * 5
