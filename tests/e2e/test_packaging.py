"""The package carries what the docs and the errors point to: the
accelerate configs, usable from an installed wheel outside the repo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIGS, REPO, check_ok, free_port


def test_the_shipped_configs_are_the_repo_s(tmp_path):
    from finetune.launch_configs import CONFIG_DIR

    repo = {p.name: p.read_bytes() for p in [*CONFIGS.glob("*.yaml"), *CONFIGS.glob("*.json")]}
    shipped = {p.name: p.read_bytes() for p in [*CONFIG_DIR.glob("*.yaml"), *CONFIG_DIR.glob("*.json")]}
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
    assert (config_file.parent / "zero2.json").is_file()  # what zero2.yaml names, shipped next to it

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


def test_a_deepspeed_json_named_by_file_name_is_found_next_to_the_shipped_configs(tmp_path, monkeypatch):
    from finetune.backends.deepspeed import find_config_file
    from finetune.errors import UsageError
    from finetune.launch_configs import CONFIG_DIR

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "zero2.json")
    find_config_file()
    assert Path(os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]) == CONFIG_DIR / "zero2.json"

    (tmp_path / "zero2.json").write_text("{}")  # the user's own, in the working directory, comes first
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "zero2.json")
    find_config_file()
    assert os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "zero2.json"

    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "configs/missing.json")
    with pytest.raises(UsageError, match="deepspeed_config_file configs/missing.json .* does not exist; "):
        find_config_file()

