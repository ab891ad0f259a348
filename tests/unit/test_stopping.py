"""Unit tests of stop requests."""

from __future__ import annotations

import os

import pytest


def test_one_stop_request_delivered_twice_is_not_a_second_request(monkeypatch):
    """Ctrl-C reaches a rank from the terminal and again from the launcher: the
    repeat, moments later, must not abandon the checkpoint; a later signal stops at once."""
    import signal
    import time

    from finetune import stopping

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    with stopping.StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # from the terminal
        clock[0] += 0.2
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's copy
        assert stop.received == signal.SIGINT and stop.flag == 1.0
        clock[0] += stopping.REPEAT_GRACE_S
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the user's second Ctrl-C
