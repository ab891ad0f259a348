"""The package carries what the README and the errors point to: the
accelerate configs, usable from an installed wheel outside the repo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIGS, REPO, check_ok, free_port


def test_the_shipped_configs_are_the_repo_s(tmp_path):
    from finetune.launch_configs import CONFIG_DIR

    repo = {p.name: p.read_bytes() for p in CONFIGS.glob("*.yaml")}
    shipped = {p.name: p.read_bytes() for p in CONFIG_DIR.glob("*.yaml")}
    assert repo.keys() == shipped.keys() and repo, "accelerate_configs/ and finetune/accelerate_configs/ differ"
    assert [name for name in repo if repo[name] != shipped[name]] == []


@pytest.mark.slow
def test_an_installed_wheel_launches_fsdp_with_its_own_config(tmp_path, env, small_corpus):
    wheels = tmp_path / "wheels"
    check_ok(subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(wheels), str(REPO)], capture_output=True, text=True, env=env))
    site = tmp_path / "site"
    check_ok(subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                             *map(str, wheels.glob("finetune-*.whl"))], capture_output=True, text=True, env=env))
    outside = tmp_path / "elsewhere"  # no accelerate_configs/ here
    outside.mkdir()
    installed = {**env, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import finetune; print(finetune.__file__)"], cwd=outside,
                           capture_output=True, text=True, env=installed)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    config = subprocess.run([sys.executable, "-m", "finetune", "configs", "--path", "fsdp"], cwd=outside,
                            capture_output=True, text=True, env=installed)
    check_ok(config)
    config_file = Path(config.stdout.strip())
    assert config_file.is_file() and str(config_file).startswith(str(site))

    run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
                          "--num_processes", "2", "--main_process_port", str(free_port()), "--mixed_precision", "no",
                          "-m", "finetune", "train", "--dataset", str(small_corpus), "--max_steps", "2",
                          "--block_size", "64", "--sample_prompt", "", "--output_dir", "run"],
                         cwd=outside, capture_output=True, text=True, env=installed, timeout=300)
    check_ok(run)
    summary = json.loads((outside / "run" / "summary.json").read_text())
    assert summary["distributed_type"] == "FSDP" and len(summary["local_params_per_rank"]) == 2
    assert sum(summary["local_params_per_rank"]) == summary["total_params"]
    assert max(summary["local_params_per_rank"]) < 0.6 * summary["total_params"]
