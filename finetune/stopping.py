"""Stopping a run cleanly on Ctrl-C (SIGINT) or SIGTERM.

The handler only records the signal. The training loop shares that record
between the ranks at every optimizer step (a rank may get the signal a moment
later than another, or not at all), so all ranks stop after the same step,
save a checkpoint together and exit. A checkpoint being written when the
signal arrives is finished first. A second signal stops at once; a launcher
that loses patience kills the ranks mid-save, and then the temporary
checkpoint dir is simply never renamed (the last complete one stays `latest`).
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt  # the second signal: stop now
        self.received = signum

    @property
    def flag(self) -> float:
        return 0.0 if self.received is None else 1.0

    def name(self) -> str:
        return signal.Signals(self.received or signal.SIGTERM).name
