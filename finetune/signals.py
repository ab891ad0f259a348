"""Warnings for runs that train without learning: a metric that says "no
signal" step after step (a zero gradient, groups whose rewards are all equal,
pairs separated from the first step). Each task names its own checks
(`Task.no_signal_checks`); the loop feeds every step's metrics to them and
prints what they say, once each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class NoSignal:
    metric: str                       # the step metric it reads (absent: the check skips the step)
    holds: Callable[[float], bool]    # the metric's value says "no signal"
    steps: int                        # for this many steps in a row
    meaning: str                      # what it means and what to check, after "<metric> is <value> for N steps: "
    from_first_step: bool = False     # only a streak that starts at the run's first step counts
    streak: int = 0
    warned: bool = False
    broken: bool = False              # from_first_step: the streak was broken

    def update(self, step: int, metrics: dict[str, float]) -> str | None:
        """The warning, the first time the streak reaches its length."""
        if self.warned or self.broken or self.metric not in metrics:
            return None
        value = metrics[self.metric]
        if not self.holds(value):
            self.streak = 0
            self.broken = self.from_first_step
            return None
        if self.from_first_step and step != self.streak + 1:  # a resumed run, or a step missed
            self.broken = True
            return None
        self.streak += 1
        if self.streak < self.steps:
            return None
        self.warned = True
        since = "since the first step" if self.from_first_step else f"for {self.steps} steps in a row"
        return f"warning: {self.metric} is {value:g} {since} (step {step}): {self.meaning}"


def zero_gradient(steps: int = 5) -> NoSignal:
    return NoSignal("grad_norm", lambda v: v == 0.0, steps,
                    "no parameter is changing; check that the loss reaches the trained parameters (--peft and its "
                    "targets, frozen layers) and that the data has targets (labels that are not all masked)")
