"""The no-signal warnings (finetune/signals.py) and the checks each objective names."""

from __future__ import annotations

from finetune.signals import NoSignal, zero_gradient


class NoSignalWatch:
    """The loop's use of a task's checks (train.after_step): each step's warnings."""

    def __init__(self, checks: list[NoSignal]):
        self.checks = checks

    def lines(self, step: int, metrics: dict[str, float]) -> list[str]:
        return [line for check in self.checks if (line := check.update(step, metrics))]


def test_a_streak_warns_once_when_it_reaches_its_length_and_a_break_restarts_it():
    watch = NoSignalWatch([zero_gradient(steps=3)])
    said = [watch.lines(step, {"grad_norm": g}) for step, g in enumerate([0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0], 1)]
    assert [i for i, lines in enumerate(said, 1) if lines] == [6]
    assert said[5][0].startswith("warning: grad_norm is 0 for 3 steps in a row (step 6): no parameter is changing")
    assert watch.lines(8, {"loss": 1.0}) == []  # a step without the metric says nothing


def test_from_the_first_step_only_counts_a_run_that_starts_there():
    def accuracy_check():
        return NoSignal("rewards/accuracies", lambda v: v >= 1.0, 3, "too easy", from_first_step=True)

    fresh = NoSignalWatch([accuracy_check()])
    assert [fresh.lines(s, {"rewards/accuracies": 1.0}) for s in (1, 2)] == [[], []]
    assert "since the first step (step 3): too easy" in fresh.lines(3, {"rewards/accuracies": 1.0})[0]
    resumed = NoSignalWatch([accuracy_check()])
    assert not any(resumed.lines(s, {"rewards/accuracies": 1.0}) for s in range(11, 20))
    learned = NoSignalWatch([accuracy_check()])
    values = [0.5, 1.0, 1.0, 1.0, 1.0]
    assert not any(learned.lines(s, {"rewards/accuracies": v}) for s, v in enumerate(values, 1))


def test_each_objective_names_its_own_checks():
    from finetune.config import TrainConfig
    from finetune.objectives import build_task

    def metrics(**kw):
        return [c.metric for c in build_task(TrainConfig(**kw)).no_signal_checks()]

    assert metrics(model="tiny-gpt2") == ["grad_norm"]
    assert metrics(model="tiny-gpt2", objective="dpo") == ["grad_norm", "rewards/accuracies"]
    assert metrics(model="tiny-gpt2", objective="grpo", reward_funcs=["format"]) == ["grad_norm", "frac_reward_zero_std"]


def test_a_step_line_holds_what_fits_the_width_and_counts_the_rest(monkeypatch):
    from finetune.report import step_line

    row = {"step": 3, "epoch": 0, "loss": 0.5, "lr": 1e-5, "grad_norm": 0.25, "step_time_s": 1.0,
           "tokens_per_sec": 1000.0, "reward": 0.5, "reward_std": 0.1, "frac_reward_zero_std": 0.0,
           **{f"rewards/fn{i}/mean": 0.5 for i in range(12)}, "rss_bytes_rank0": 10}
    for width in (90, 120, 200):
        line = step_line(row, 10, "tokens_per_sec", width=width)
        assert len(line) <= width and line.startswith("step 3/10  loss 0.5000") and "rss_bytes" not in line
        shown = line.count("  reward") + line.count("  frac_reward")
        assert line.endswith(f"  (+{15 - shown} more)") and (width < 120 or shown >= 2), line
    assert "more)" not in step_line(row, 10, "tokens_per_sec", width=1000)
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert len(step_line(row, 10, "tokens_per_sec")) <= 100
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a file or a pipe, whatever COLUMNS says: every metric
    assert "more)" not in step_line(row, 10, "tokens_per_sec") and "rewards/fn11/mean" in step_line(row, 10, "tokens_per_sec")
