"""What a run prints where there is no terminal (a CI log, a file): plain
lines, one per logged step and one per evaluation, nothing redrawn."""

from __future__ import annotations

import re

import pytest
from conftest import check_ok, common_args, eval_rows, run_cli, train_rows


@pytest.mark.slow
def test_a_redirected_run_prints_plain_lines(tmp_path, env, small_corpus):
    run_dir = tmp_path / "run"
    proc = run_cli(["train", *common_args(small_corpus), "--max_steps", "7", "--log_every", "2", "--eval_every", "3",
                    "--checkpoint_every", "3", "--output_dir", str(run_dir)], env, mixed_precision="no", warm=True)
    check_ok(proc)
    output = proc.stdout + proc.stderr
    assert "\r" not in output
    lines = output.splitlines()
    assert max(len(line) for line in lines) <= 300
    steps = [int(m.group(1)) for line in lines if (m := re.match(r"step (\d+)/7  loss [\d.]+  lr ", line))]
    assert steps == [r["step"] for r in train_rows(run_dir)] == [2, 4, 6, 7]
    evals = [int(m.group(1)) for line in lines if (m := re.match(r"eval at step (\d+): loss [\d.]+, perplexity", line))]
    assert evals == [r["step"] for r in eval_rows(run_dir)] == [0, 3, 6, 7]
    assert sum(line.startswith("saved checkpoint ") for line in lines) == 3  # steps 3, 6 and the final 7


def test_a_terminal_gets_the_bar_unless_bars_are_disabled_or_plain_is_asked_for(monkeypatch):
    import sys

    from finetune.report import plain_logs

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert not plain_logs("auto") and plain_logs("plain")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert plain_logs("auto") and not plain_logs("bar")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    monkeypatch.delenv("TQDM_DISABLE")
    assert plain_logs("auto")
