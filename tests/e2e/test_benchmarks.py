"""`finetune evaluate MODEL --tasks`: lm-evaluation-harness scores, offline on
the shipped task built from the embedded questions, equal to lm-eval's own CLI
on the same dir, and written into the model dir, its card and its run's summary."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, check_ok, run_in_process
from e2e.test_errors import one_error_line

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

TASK = "finetune_stdlib_qa"


def test_scores_equal_lm_evals_own_cli_and_are_recorded(checkpointed_run, tmp_path, env):
    run_dir = tmp_path / "run"
    shutil.copytree(checkpointed_run, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    final = run_dir / "final"
    proc = run_in_process("evaluate", final, "--tasks", TASK)
    check_ok(proc)
    ours = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ours["dtype"] in ("float32", "bfloat16") and ours["device"] == "cpu"

    out = tmp_path / "lm_eval_out"
    cli = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                          f"pretrained={final},dtype={ours['dtype']}", "--tasks", TASK, "--include_path",
                          str(REPO / "finetune" / "lm_eval_tasks"), "--device", "cpu", "--batch_size", "8",
                          "--output_path", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    check_ok(cli)
    theirs = json.loads(next(out.rglob("results*.json")).read_text())["results"][TASK]
    scores = ours["results"][TASK]
    assert scores["sample_len"] == 72  # every held-out question of the default split
    for metric in ("acc,none", "acc_norm,none"):
        assert scores[metric] == theirs[metric], metric
    assert 0 <= scores["acc,none"] <= 1

    assert json.loads((final / "lm_eval_results.json").read_text())["results"][TASK] == scores
    assert json.loads((run_dir / "summary.json").read_text())["lm_eval"][TASK] == scores
    card = (final / "README.md").read_text()
    assert f"`{TASK}`: acc {scores['acc,none']:.4f}" in card and "Held-out perplexity of this model" in card


def test_bad_benchmark_input_is_one_line(checkpointed_run, tmp_path):
    final = checkpointed_run / "final"
    for args, words in ((["--tasks", "finetune_stdlib_q"], "did you mean finetune_stdlib_qa"),
                        (["--tasks", TASK, "--tasks_dir", tmp_path / "missing"], "not a directory"),
                        (["--limit", "3"], "--limit is for --tasks")):
        proc = run_in_process("evaluate", final, *args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert words in one_error_line(proc.stderr), proc.stderr[-500:]
    proc = run_in_process("evaluate", tmp_path, "--tasks", TASK)
    assert proc.returncode == 2 and "no config.json" in one_error_line(proc.stderr)
    assert not (final / "lm_eval_results.json").exists()  # the shared run is left as it was


def test_scores_never_go_through_links_nor_over_a_card_its_user_wrote(checkpointed_run, tmp_path):
    """The files `evaluate --tasks` writes in a model dir and its run: links
    standing at their names lead outside, and are replaced, never written
    through (summary.json, not ours to replace there, is left alone); a
    README.md its user rewrote stays theirs."""
    run_dir = tmp_path / "run"
    shutil.copytree(checkpointed_run, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    final = run_dir / "final"
    outside = {name: tmp_path / f"outside-{name}" for name in ("lm_eval_results.json", "summary.json")}
    for name, target in outside.items():
        target.write_text("not yours")
    (final / "lm_eval_results.json").symlink_to(outside["lm_eval_results.json"])
    (run_dir / "summary.json").unlink()
    (run_dir / "summary.json").symlink_to(outside["summary.json"])
    (final / "README.md").write_text("# My model\n\nNotes I wrote.\n")
    proc = run_in_process("evaluate", final, "--tasks", TASK, "--limit", "4")
    check_ok(proc)
    assert all(target.read_text() == "not yours" for target in outside.values())
    results = final / "lm_eval_results.json"
    assert not results.is_symlink() and TASK in json.loads(results.read_text())["results"]
    assert (run_dir / "summary.json").is_symlink()
    assert (final / "README.md").read_text() == "# My model\n\nNotes I wrote.\n"
    assert f"left {final / 'README.md'} as it is" in proc.stderr
