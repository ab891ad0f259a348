"""The loop's bookkeeping between two optimizer steps (`after_step`), driven by
hand in this process: one rank, no process group, a real Accelerator,
checkpoint manager, LR schedule and metrics file, and a task whose
evaluation only counts its calls."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from finetune.checkpoint import CheckpointManager, TrainingProgress, read_progress
from finetune.config import load_config
from finetune.backends import OneProcess
from finetune.backends.accelerator import build_accelerator
from finetune.backends.base import ShardReport
from finetune.data.stream import EpochBatches, SourceTally
from finetune.liveness import Heartbeats
from finetune.errors import Stopped, UsageError
from finetune.models import build_cnn
from finetune.optim import LRSchedule, build_optimizer, build_scheduler
from finetune.presets import CNN_PRESETS
from finetune.report import JSONLTracker
from finetune.stopping import StopSignals
from finetune.tasks.base import Task, TaskData
from finetune.train import Run, StepResult, after_step


class CountingTask(Task):
    name = "image-classification"
    metric_name = "accuracy"
    throughput_key = "samples_per_sec"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.evaluated_at: list[int] = []
        self.run: Run | None = None

    def evaluate(self, model, loader, accelerator):
        self.evaluated_at.append(self.run.progress.step)
        return {"eval_loss": 0.5, "accuracy": 0.75}


def make_run(run_dir: Path) -> Run:
    cfg = load_config(None, {"task": "image-classification", "output_dir": str(run_dir), "max_steps": 10,
                             "eval_every": 2, "checkpoint_every": 3, "per_device_batch_size": 4,
                             "gradient_accumulation_steps": 1})
    run_dir.mkdir(parents=True)
    accelerator = build_accelerator(1, cfg.seed, [JSONLTracker(run_dir / "metrics.jsonl")], run_dir)
    accelerator.init_trackers("after-step-test")
    model = build_cnn(CNN_PRESETS["lecture-cnn"])
    optimizer = build_optimizer(model, cfg)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, build_scheduler(optimizer, cfg, 10))
    task = CountingTask(cfg)
    train_batches = EpochBatches(None, accelerator, global_batch=4)  # steps are made up here: no data is read
    checkpoints = CheckpointManager(accelerator, model, run_dir, every=cfg.checkpoint_every, every_epochs=0,
                                    keep_last=0, config_yaml="task: image-classification\n", tokenizer=None,
                                    peft=task.peft, data=[train_batches])
    params = sum(p.numel() for p in model.parameters())
    run = Run(cfg=cfg, accelerator=accelerator, backend=OneProcess(), task=task, data=TaskData([], [], None, "none"), model=model,
              optimizer=optimizer, schedule=LRSchedule.for_config(scheduler, optimizer, cfg), train_batches=train_batches,
              sources=SourceTally(cfg.sources, cfg.source_weights), eval_loader=None, checkpoints=checkpoints, stop=StopSignals(),
              heartbeats=Heartbeats(run_dir, accelerator, cfg.ddp_timeout), total_steps=10,
              progress=TrainingProgress(), shards=ShardReport(params, [params]), fsdp_units=0)
    task.run = run
    return run


def step(loss: float, epoch_end: bool = False, stop_votes: int = 0) -> StepResult:
    return StepResult(loss, units=4, stop_votes=stop_votes, grad_norm=1.5, lr=0.01, seconds=0.25, epoch_end=epoch_end)


def test_after_step_through_epoch_end_evaluation_checkpoint_and_stop(tmp_path):
    run_dir = tmp_path / "run"
    run = make_run(run_dir)
    lr = run.schedule.lr

    after_step(run, step(2.0))  # step 1: nothing is due
    assert run.progress.step == 1 and run.last_loss == 2.0
    assert run.task.evaluated_at == [] and not (run_dir / "checkpoints").exists()
    assert run.schedule.lr == lr  # the lectures' StepLR counts epochs, not steps

    after_step(run, step(4.0, epoch_end=True))  # step 2: the epoch ends and an evaluation is due
    assert run.progress.epoch == 1 and run.train_batches.state_dict()["samples_in_epoch"] == 0 and run.progress.epoch_steps == 0
    assert run.schedule.lr == pytest.approx(lr * run.cfg.lr_gamma)
    assert run.task.evaluated_at == [2]

    after_step(run, step(1.0))  # step 3: a checkpoint is due
    checkpoint = run_dir / "checkpoints" / "step_000003"
    assert checkpoint.is_dir() and read_progress(checkpoint).step == 3
    assert read_progress(checkpoint).epoch == 1 and read_progress(checkpoint).epoch_loss_sum == 1.0

    run.stop.received = signal.SIGTERM  # as the handler records a Ctrl-C or SIGTERM
    with pytest.raises(Stopped, match="SIGTERM at step 4; checkpoint .*step_000004 is complete") as stopped:
        after_step(run, step(3.0, stop_votes=1))
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert read_progress(run_dir / "checkpoints" / "step_000004").step == 4
    assert run.task.evaluated_at == [2, 4]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert [(r["step"], r["loss"], r["epoch"]) for r in train] == [(1, 2.0, 0), (2, 4.0, 0), (3, 1.0, 1), (4, 3.0, 1)]
    assert all(r["samples_per_sec"] == 4 / 0.25 and r["grad_norm"] == 1.5 for r in train)
    assert [(r["step"], r["epoch_loss"]) for r in rows if "epoch_loss" in r] == [(2, 3.0)]  # mean of 2.0 and 4.0
    assert [(r["step"], r["accuracy"]) for r in rows if "eval_loss" in r] == [(2, 0.75), (4, 0.75)]


def test_after_step_refuses_a_non_finite_loss_and_names_the_checkpoint_to_go_back_to(tmp_path):
    run = make_run(tmp_path / "run")
    for loss in (2.0, 2.0, 2.0, 2.0):  # a checkpoint at step 3
        after_step(run, step(loss))
    with pytest.raises(UsageError, match="the loss is nan at step 5.*newest checkpoint whose weights still gave a "
                                         "finite loss is .*step_000003"):
        after_step(run, step(float("nan")))


def test_a_non_finite_first_loss_is_not_blamed_on_the_learning_rate(tmp_path):
    """The first step's loss comes from the weights the run loaded, before any update of its own."""
    run = make_run(tmp_path / "run")
    with pytest.raises(UsageError, match="the loss is inf at step 1, the first this run trained, before any update "
                                         "of its own: the weights it started from or the data give it") as refused:
        after_step(run, step(float("inf")))
    assert "--learning_rate" not in str(refused.value)


def test_the_learning_rate_suggested_after_a_nan_is_a_tenth_and_never_absurd(tmp_path):
    from finetune.train import SANE_LEARNING_RATE, non_finite_loss_message

    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    for rate, suggested in ((1e-4, "1e-05"), (1e6, f"{SANE_LEARNING_RATE:g}"), (5e-3, "0.0005")):
        message = non_finite_loss_message(float("nan"), 9, tmp_path, rate)
        assert message.endswith(f"--learning_rate {suggested}`"), message
