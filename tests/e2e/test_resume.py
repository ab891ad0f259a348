"""Sharded checkpoints and resume: exact continuation, resharding to another
world size, a real SIGKILL, and clear errors for checkpoints that do not fit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import CONFIGS, REPO, check_ok, common_args, eval_rows, free_port, run_cli, train_rows
from e2e.test_memory_planner import assert_predicted

pytestmark = pytest.mark.slow


def interrupted_copy(source: Path, step: int, target: Path, metrics: bool = False) -> Path:
    """What a run stopped right after checkpointing at `step` leaves behind
    (with `metrics`, its metrics.jsonl too, rows after `step` included)."""
    (target / "checkpoints").mkdir(parents=True)
    shutil.copy(source / "run_config.yaml", target)
    if metrics:
        shutil.copy(source / "metrics.jsonl", target)
    shutil.copytree(source / "tokenizer", target / "tokenizer")
    name = f"step_{step:06d}"
    shutil.copytree(source / "checkpoints" / name, target / "checkpoints" / name)
    return target


def consolidated(shard_dir: Path, tmp: Path) -> dict:
    out = tmp / f"{shard_dir.parent.parent.parent.name}-{shard_dir.name}.pt"
    dcp_to_torch_save(shard_dir, out)
    return torch.load(out, weights_only=True)


def flatten(tree, prefix="") -> dict:
    if isinstance(tree, (dict, list, tuple)):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        out = {}
        for k, v in items:
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): tree}


def assert_same_state(saved: Path, resaved: Path, tmp: Path) -> dict:
    """The model and optimizer state of two checkpoints, consolidated, equal
    whatever their shard layouts; the optimizer's, flattened."""
    for part in ["pytorch_model_fsdp_0", "optimizer_0"]:
        before = flatten(consolidated(saved / part, tmp))
        after = flatten(consolidated(resaved / part, tmp))
        assert before.keys() == after.keys()
        for key in before:
            if isinstance(before[key], torch.Tensor):
                assert torch.equal(before[key], after[key]), key
            else:
                assert before[key] == after[key], key
    return before


def test_checkpoint_layout(checkpointed_run):
    ckpt = checkpointed_run / "checkpoints" / "step_000006"
    # tiny-gpt2's output layer is its input embedding: stored once.
    stored = dcp.FileSystemReader(str(ckpt / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata
    assert "model.transformer.wte.weight" in stored and not any("lm_head" in name for name in stored)
    progress = json.loads((ckpt / "training_progress.json").read_text())
    assert progress["step"] == 6 and progress["epoch"] == 0 and progress["world_size"] == 2
    assert progress["samples_in_epoch"] == 6 * 8
    assert sorted(p.name for p in (ckpt / "pytorch_model_fsdp_0").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert len(list((ckpt / "optimizer_0").glob("*.distcp"))) == 2
    assert (ckpt / "random_states_0.pkl").is_file() and (ckpt / "random_states_1.pkl").is_file()
    assert (ckpt / "scheduler.bin").is_file() and (ckpt / "run_config.yaml").is_file()


def test_resume_typed_in_a_plain_shell_continues_exactly(checkpointed_run, tmp_path, env):
    run_dir = interrupted_copy(checkpointed_run, 6, tmp_path / "resumed", metrics=True)
    proc = run_cli(["resume", str(run_dir)], env, nproc=None)  # no launcher: relaunched as run_config.yaml records
    check_ok(proc)
    # The run's first evaluation (step 0, before the interruption) stays in the summary and the console line.
    first = eval_rows(checkpointed_run)[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert first["step"] == 0 and summary["first_eval"]["perplexity"] == first["perplexity"]
    last = summary["last_eval"]["perplexity"]
    assert f"validation perplexity: {first['perplexity']:.4f} -> {last:.4f}" in proc.stdout
    assert ("relaunching as the run was launched: accelerate launch --config_file RECORDED_CONFIG --num_processes 2 "
            "--mixed_precision no --main_process_port ") in proc.stdout
    assert summary["distributed_type"] == "FSDP" and summary["world_size"] == 2
    assert len(set(summary["local_params_per_rank"])) == 1 and sum(summary["local_params_per_rank"]) == summary["total_params"]
    full = {r["step"]: r for r in train_rows(checkpointed_run)}
    resumed = train_rows(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, 13))  # rows 7-12 logged again, once
    for row in resumed[6:]:
        assert row["loss"] == pytest.approx(full[row["step"]]["loss"], abs=1e-6), row["step"]
        assert row["lr"] == pytest.approx(full[row["step"]]["lr"], rel=1e-12), row["step"]


@pytest.mark.parametrize("world_size", [1, 3])
def test_resume_on_another_world_size(checkpointed_run, tmp_path, env, small_corpus, world_size):
    saved = checkpointed_run / "checkpoints" / "step_000006"
    # Load on `world_size` ranks and save straight away (max_steps 6: nothing to train).
    run_dir = tmp_path / f"on{world_size}"
    # 1 rank x 8 keeps the global batch of 2 x 4, so the losses can be compared too.
    batch = ["--per_device_batch_size", "8"] if world_size == 1 else []
    proc = run_cli(["train", *common_args(small_corpus), *batch, "--max_steps", "6", "--resume_from_checkpoint",
                    str(saved), "--output_dir", str(run_dir)], env, nproc=world_size, mixed_precision="no", warm=True)
    check_ok(proc)
    assert f"checkpoint written by 2 rank(s), resuming on {world_size}" in proc.stdout
    # Not the launcher's one thread per worker: the cores shared by the processes on this machine.
    assert f"; {max(1, len(os.sched_getaffinity(0)) // world_size)} CPU thread(s) per process" in proc.stdout
    # Only the rank that had no saved RNG stream says so, prefixed with its rank.
    rng_warnings = [line for line in proc.stderr.splitlines() if "no RNG state for this rank" in line]
    assert [w.split("]")[0] for w in rng_warnings] == (["[rank 2"] if world_size == 3 else []), rng_warnings
    resaved = run_dir / "checkpoints" / "step_000006"
    assert len(list((resaved / "pytorch_model_fsdp_0").glob("*.distcp"))) == world_size
    optimizer = assert_same_state(saved, resaved, tmp_path)
    assert any("exp_avg_sq" in k for k in optimizer)

    # ... and training goes on from step 7 with the checkpointed_run run's LR. Launched afresh: its peak
    # resident set is held to the planner's (a forked rank shares the fork server's pages).
    check_ok(run_cli(["resume", str(run_dir), "--max_steps", "12"], env, nproc=world_size, mixed_precision="no"))
    full = {r["step"]: r for r in train_rows(checkpointed_run)}
    resumed = train_rows(run_dir)
    assert [r["step"] for r in resumed] == list(range(7, 13))
    for row in resumed:
        assert row["lr"] == pytest.approx(full[row["step"]]["lr"], rel=1e-12)
        if world_size == 1:  # same global batch, same samples
            assert row["loss"] == pytest.approx(full[row["step"]]["loss"], abs=1e-5)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == world_size and summary["distributed_type"] == "FSDP"
    assert max(summary["state_bytes_per_rank"]) == pytest.approx(predicted_fsdp_state(world_size), rel=0.10)
    assert_predicted(summary, "tiny-gpt2", world_size, batch=8 if world_size == 1 else 4, block_size=64)


def predicted_fsdp_state(world_size: int) -> int:
    """`finetune estimate-memory`'s per-rank state for tiny-gpt2 under FSDP full shard."""
    from finetune.memory import estimate, model_shape

    rows = estimate(model_shape("tiny-gpt2"), world_size, batch=4, block_size=64, mixed_precision="no")
    return next(e for e in rows if e.strategy == "FSDP full shard").state


def test_memory_estimate_matches_the_measured_state_at_2_ranks(checkpointed_run):
    summary = json.loads((checkpointed_run / "summary.json").read_text())
    assert max(summary["state_bytes_per_rank"]) == pytest.approx(predicted_fsdp_state(2), rel=0.10)


def _launch_background(args: list[str], env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "fsdp.yaml"),
           "--num_processes", "2", "--main_process_port", str(free_port()), "--mixed_precision", "no",
           "-m", "finetune", *args]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _rank_pids(launcher_pid: int) -> list[int]:
    """Worker processes (python -m finetune) below the launcher."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    children: dict[int, list[tuple[int, str]]] = {}
    for line in out:
        pid, ppid, args = line.split(None, 2)
        children.setdefault(int(ppid), []).append((int(pid), args))
    found, todo = [], [launcher_pid]
    while todo:
        for pid, args in children.get(todo.pop(), []):
            todo.append(pid)
            if "-m finetune" in args and "accelerate" not in args:
                found.append(pid)
    return found


def _kill_rank_when(proc: subprocess.Popen, ready, what: str) -> None:
    deadline = time.time() + 240
    while not ready():
        assert proc.poll() is None, f"run ended before {what}\n{proc.stdout.read()[-3000:]}"
        assert time.time() < deadline, f"no {what} within 240 s"
        time.sleep(0.002)
    ranks = _rank_pids(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)


def _crash_then_resume(run_dir: Path, env: dict, corpus: Path, kill_when, what: str) -> int:
    """SIGKILL rank 1 once `kill_when()` holds; then resume `latest` to 2 steps
    past the newest complete checkpoint. Returns that checkpoint's step."""
    args = ["train", *common_args(corpus), "--max_steps", "400", "--checkpoint_every", "4",
            "--output_dir", str(run_dir)]
    proc = _launch_background(args, env)
    try:
        _kill_rank_when(proc, kill_when, what)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert not (run_dir / "final").exists()
    complete = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    newest = int(complete[-1].split("_")[1])
    resumed = run_cli(["train", *common_args(corpus), "--max_steps", str(newest + 2), "--checkpoint_every", "4",
                       "--output_dir", str(run_dir), "--resume_from_checkpoint", "latest"], env, mixed_precision="no", warm=True)
    check_ok(resumed)
    assert f"resumed from {run_dir / 'checkpoints' / complete[-1]} at step {newest}" in resumed.stdout
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, newest + 3)), "each step logged once"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == newest + 2
    return newest


def test_sigkill_of_a_rank_mid_training_then_resume_latest(tmp_path, env, small_corpus):
    run_dir = tmp_path / "crash"
    newest = _crash_then_resume(run_dir, env, small_corpus,
                                lambda: (run_dir / "checkpoints" / "step_000008").is_dir(), "the second checkpoint")
    assert newest >= 8


def test_sigkill_of_a_rank_while_a_checkpoint_is_written(tmp_path, env, small_corpus):
    run_dir = tmp_path / "crash"
    temp = run_dir / "checkpoints" / ".tmp-step_000008"
    newest = _crash_then_resume(run_dir, env, small_corpus,
                                lambda: (temp / "pytorch_model_fsdp_0").is_dir(), "the step-8 save")
    if (run_dir / "checkpoints" / "step_000008").is_dir():
        pytest.skip("the step-8 save completed before the kill landed; nothing half-written to test")
    assert newest == 4, "the half-written step-8 checkpoint must not be used"


def test_resume_auto_starts_fresh_then_resumes_exactly(tmp_path, env, small_corpus):
    """One job script for a requeued job: the same command starts a run in an
    empty dir, and continues it from its newest checkpoint after preemption."""
    def command(run_dir: Path) -> list[str]:
        return ["train", *common_args(small_corpus), "--max_steps", "4", "--checkpoint_every", "2",
                "--resume_from_checkpoint", "auto", "--output_dir", str(run_dir)]

    first = tmp_path / "first"
    check_ok(run_cli(command(first), env, mixed_precision="no", warm=True))  # nothing to resume: starts fresh
    losses = [r["loss"] for r in train_rows(first)]
    assert len(losses) == 4
    requeued = interrupted_copy(first, 2, tmp_path / "requeued")
    proc = run_cli(command(requeued), env, mixed_precision="no", warm=True)
    check_ok(proc)
    assert "resumed from" in proc.stdout and "step_000002" in proc.stdout
    assert [r["step"] for r in train_rows(requeued)] == [3, 4]
    assert [r["loss"] for r in train_rows(requeued)] == pytest.approx(losses[2:], rel=1e-6, abs=1e-6)
