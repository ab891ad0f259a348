"""The Slurm job script's per-node launch, run for 2 "nodes" of 2 processes on
loopback with the SLURM_* values srun would give them: one HSDP job, a replica
per node sharded over its processes, and the same command again continues it
(resume auto)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, common_args, free_port, train_rows

pytestmark = pytest.mark.slow


def run_nodes(env: dict, run_dir: Path, extra: list[str]) -> None:
    port = str(free_port())
    nodes = []
    for node in ("0", "1"):
        node_env = {**env, "SLURM_NNODES": "2", "SLURM_NODEID": node, "MAIN_ADDR": "127.0.0.1", "MAIN_PORT": port,
                    "PROCS_PER_NODE": "2", "OUTPUT_DIR": str(run_dir),
                    "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}
        nodes.append(subprocess.Popen(["bash", "scripts/slurm/node_launch.sh", *extra], cwd=REPO, env=node_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for node in nodes:
        _, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-3000:]


def test_the_slurm_node_launch_shards_within_each_node_and_resumes(tmp_path, env, small_corpus):
    run_dir = tmp_path / "run"
    args = [*common_args(small_corpus), "--checkpoint_every", "2"]
    run_nodes(env, run_dir, [*args, "--max_steps", "2"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["distributed_type"], summary["world_size"]) == ("FSDP", 4)
    assert summary["parallelism"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1}
    # Each node's two ranks hold the whole model between them; each rank about half.
    local, total = summary["local_params_per_rank"], summary["total_params"]
    assert sum(local[:2]) == sum(local[2:]) == total and max(local) < 0.6 * total
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "step_000002" / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert shards == [f"__{rank}_0.distcp" for rank in range(4)]

    run_nodes(env, run_dir, [*args, "--max_steps", "4"])  # requeued with a longer run: continues from step 2
    assert [r["step"] for r in train_rows(run_dir)] == [1, 2, 3, 4]
