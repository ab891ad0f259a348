"""HSDP (hsdp.yaml): replicas of an FSDP-sharded model, launched on 4 CPU
processes over gloo, checked from the outside: the losses of flat FSDP on the
same 4 ranks, each rank holding half the model, each replica's ranks holding
all of it, the checkpoint storing it once and resuming under plain FSDP."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import check_ok, common_args, dcp_elements_per_file, run_cli, run_cli_together, train_rows

pytestmark = pytest.mark.slow


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_hsdp_trains_as_fsdp_does_on_half_the_model_per_rank_and_resumes_under_fsdp(tmp_path, env, small_corpus):
    args = [*common_args(small_corpus), "--max_steps", "4", "--checkpoint_every", "2"]
    runs = {config: tmp_path / config for config in ("fsdp.yaml", "hsdp.yaml")}
    for proc in run_cli_together([(["train", *args, "--output_dir", str(run_dir)],
                                   {"config": config, "nproc": 4, "mixed_precision": "no"})
                                  for config, run_dir in runs.items()], env):
        check_ok(proc)
    flat, hybrid = (summary(runs[c]) for c in runs)
    assert flat["parallelism"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 1}
    assert hybrid["parallelism"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1}

    # The same global batch (4 ranks x 4) and the same averaged gradient: the same losses.
    flat_losses = [r["loss"] for r in train_rows(runs["fsdp.yaml"])]
    hybrid_losses = [r["loss"] for r in train_rows(runs["hsdp.yaml"])]
    assert len(hybrid_losses) == 4 and hybrid_losses == pytest.approx(flat_losses, abs=1e-5)

    # Flat: a quarter each. HSDP: ranks 0-1 and 2-3 each hold the whole model, half of it each.
    total = hybrid["total_params"]
    assert sum(flat["local_params_per_rank"]) == total and max(flat["local_params_per_rank"]) < 0.3 * total
    local = hybrid["local_params_per_rank"]
    assert sum(local[:2]) == sum(local[2:]) == total
    assert all(abs(n - total / 2) <= 0.02 * total for n in local), local
    # Replicated shards are stored once, spread over the replicas' files.
    checkpoint = runs["hsdp.yaml"] / "checkpoints" / "step_000002"
    stored = dcp_elements_per_file(checkpoint / "pytorch_model_fsdp_0", skip=set())
    assert len(stored) == 4 and sum(stored.values()) == total, stored

    # The HSDP checkpoint of step 2 continues under flat FSDP on 2 ranks of 8
    # (the same global batch of 16): steps 3 and 4 as the HSDP run had them.
    resumed = tmp_path / "resumed"
    proc = run_cli(["train", *args, "--per_device_batch_size", "8", "--resume_from_checkpoint", str(checkpoint),
                    "--output_dir", str(resumed)], env, nproc=2, mixed_precision="no")
    check_ok(proc)
    assert "checkpoint written by 4 rank(s), resuming on 2" in proc.stdout
    assert summary(resumed)["parallelism"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1}
    rows = train_rows(resumed)
    assert [r["step"] for r in rows] == [3, 4]
    assert [r["loss"] for r in rows] == pytest.approx(hybrid_losses[2:], abs=1e-5)


def test_a_mesh_that_does_not_fit_the_launch_stops_in_one_line(tmp_path, env, small_corpus):
    """hsdp.yaml's 2 x 2 mesh on 2 processes: every rank stops before its process
    group with the same line, and no run dir is made."""
    run_dir = tmp_path / "run"
    proc = run_cli(["train", *common_args(small_corpus), "--max_steps", "1", "--output_dir", str(run_dir)], env,
                   nproc=2, config="hsdp.yaml", mixed_precision="no")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and all(e == errors[0] for e in errors), proc.stderr[-2000:]
    assert "2 x dp_shard 2 x tp 1 = 4 ranks, but 2 were launched" in errors[0]
    assert "Traceback" not in "\n".join(line for line in proc.stderr.splitlines() if "[rank" in line)
    assert not run_dir.exists()
