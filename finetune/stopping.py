"""Stopping a run cleanly on Ctrl-C (SIGINT) or SIGTERM.

The handler only records the signal. The training loop shares that record
between the ranks at every optimizer step (a rank may get the signal a moment
later than another, or not at all), so all ranks stop after the same step,
save a checkpoint together and exit. A checkpoint being written when the
signal arrives is finished first. A second signal stops at once; a launcher
that loses patience kills the ranks mid-save, and then the temporary
checkpoint dir is simply never renamed (the last complete one stays `latest`).

One stop request often reaches a rank twice: Ctrl-C goes to every process of
the terminal's foreground group (the ranks and the launcher), Slurm's scancel
to every process of the job step, and the launcher passes its own copy on to
the ranks. So a repeat within REPEAT_GRACE_S of the first signal is that same
request, not the second one (which would lose the checkpoint and the line that
names it).
"""

from __future__ import annotations

import os
import signal
import threading
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_GRACE_S = 2.0


_ACTIVE: list["StopSignals"] = []  # the run's, while it is entered


def stop_requested(longer_than_s: float = 0.0) -> str | None:
    """The signal's name when a stop was asked for more than `longer_than_s`
    ago: what waits on user code (a reward function) gives up then."""
    for stop in _ACTIVE:
        if stop.received is not None and time.monotonic() - stop._received_at > longer_than_s:
            return stop.name()
    return None


class StopSignals:
    def __init__(self):
        self.received: int | None = None
        self._received_at = 0.0
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._received_at = signum, now
        elif now - self._received_at > REPEAT_GRACE_S:
            raise KeyboardInterrupt  # a second request: stop now

    @property
    def flag(self) -> float:
        return 0.0 if self.received is None else 1.0

    def name(self) -> str:
        return signal.Signals(self.received or signal.SIGTERM).name


def leave_the_launch(_worker_id: int | None = None) -> None:
    """A data worker's start (a DataLoader's worker_init_fn, a stream's pool
    initializer). It leaves the launch's process group, so that a stop sent to
    the whole launch (Ctrl-C, a scheduler's SIGTERM to the group) reaches the
    ranks alone, which save and then close their workers; a worker killed first
    would fail the rank's next batch instead. The rank's stop handlers it
    inherited only record a request: a worker dies of SIGTERM, and ignores SIGINT."""
    os.setpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
