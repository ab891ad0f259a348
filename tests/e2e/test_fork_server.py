"""The tests' fork server (tests/fork_server.py), which most of the suite's
runs are forked from, against real `accelerate launch` runs: a forked run is
the launched run to the bit (losses, the checkpoint's files and their shards),
and a rank that dies ends its run at once and leaves the server as it was."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import ForkServer, check_ok, common_args, dcp_elements_per_file, launch_options, read_jsonl, run_cli

pytestmark = pytest.mark.slow


def test_a_rank_that_dies_ends_its_run_and_not_the_server(tmp_path, env, small_corpus):
    """Rank 1 killed mid-run: torchrun's agent ends rank 0 (blocked in a
    collective with it) and the run fails within seconds; the next run on the
    server (the tests below) is untouched. Runs first in this file for that."""
    args, run_dir, conn = ForkServer.submit(
        ["train", *common_args(small_corpus), "--max_steps", "500", "--output_dir", str(tmp_path / "run")],
        launch_options(2, "fsdp.yaml", "no", ()), env)
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "metrics.jsonl").exists():  # training, the ranks in their collectives
        assert time.monotonic() < deadline, ForkServer.read(run_dir, ["err-0", "err-1", "launcher.log"])
        time.sleep(0.2)
    ranks = [int((run_dir / f"pid-{rank}").read_text()) for rank in (0, 1)]
    os.kill(ranks[1], signal.SIGKILL)
    killed = time.monotonic()
    proc = ForkServer.collect(args, run_dir, conn, deadline=killed + 60, timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - killed < 45  # the agent's 30 s of grace for rank 0, at the most
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]  # both ended and reaped


SAVE_ID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def comparable(path: Path) -> bytes:
    """A checkpoint file's bytes, less what differs between any two saves: the
    random save id in DCP's .metadata, and so its hash in the manifest."""
    data = path.read_bytes()
    if path.name == ".metadata":
        return SAVE_ID.sub(b"SAVE_ID", data)
    if path.name == "manifest.json":
        manifest = json.loads(data)
        for name, entry in manifest["files"].items():
            if name.endswith(".metadata"):
                entry.pop("sha256")
        return json.dumps(manifest).encode()
    return data


@pytest.mark.parametrize("config", ["fsdp.yaml", "ddp.yaml", "zero2.yaml"])
def test_a_forked_run_is_the_launched_run(config, tmp_path, env, small_corpus):
    """The same training launched, then forked into the same dir (the
    checkpoints record their path): equal losses and gradient norms, the same
    checkpoint files byte for byte, and under FSDP the same shard per rank."""
    run_dir, launched_dir = tmp_path / "run", tmp_path / "launched"
    args = ["train", *common_args(small_corpus), "--max_steps", "4", "--checkpoint_every", "2", "--eval_every", "2",
            "--output_dir", str(run_dir)]
    check_ok(run_cli(args, env, config=config, mixed_precision="no"))
    run_dir.rename(launched_dir)
    check_ok(run_cli(args, env, config=config, mixed_precision="no", warm=True))

    def losses(run_dir: Path) -> list[tuple]:
        return [(r["step"], r.get("loss"), r.get("eval_loss"), r.get("grad_norm"))
                for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r or "eval_loss" in r]

    assert losses(run_dir) == losses(launched_dir) and len(losses(launched_dir)) >= 6
    launched, forked = launched_dir / "checkpoints", run_dir / "checkpoints"
    files = sorted(p.relative_to(launched) for p in launched.rglob("*") if p.is_file())
    assert sorted(p.relative_to(forked) for p in forked.rglob("*") if p.is_file()) == files
    assert any(p.suffix in (".distcp", ".pt", ".safetensors", ".bin") for p in files)  # the weights among them
    assert [str(name) for name in files if comparable(launched / name) != comparable(forked / name)] == []
    for shard_dir in launched.glob("step_*/pytorch_model_fsdp_0"):  # FSDP's model: a shard file per rank
        per_file = dcp_elements_per_file(shard_dir, skip=set())
        assert len(per_file) == 2
        assert dcp_elements_per_file(forked / shard_dir.relative_to(launched), skip=set()) == per_file
