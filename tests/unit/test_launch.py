"""Unit tests of finetune resume's relaunch."""

from __future__ import annotations

import json

import pytest

from finetune.errors import UsageError

RECORDED = {"distributed_type": "FSDP", "num_processes": 2, "num_machines": 1,
            "launcher_options": ["--num_processes", "2", "--mixed_precision", "no"],
            "accelerate_config": {"distributed_type": "FSDP", "num_processes": 2}}


def test_relaunch_replays_the_recorded_launch_with_a_new_process_count(tmp_path):
    from finetune.launch import relaunch_command

    config = tmp_path / "accelerate_config.yaml"
    command = relaunch_command(tmp_path, RECORDED, ["resume", "RUN", "--max_steps", "9"], 3, config)
    start = command.index("accelerate.commands.launch") + 1
    finetune = command.index("-m", start)
    launch = command[start:finetune]
    assert launch[:2] == ["--config_file", str(config)]
    assert launch.count("--num_processes") == 1 and launch[launch.index("--num_processes") + 1] == "3"
    assert launch[launch.index("--mixed_precision") + 1] == "no" and "--main_process_port" in launch
    assert command[finetune:] == ["-m", "finetune", "resume", "RUN", "--max_steps", "9"]
    # A run started without accelerate launch resumes in place; one over several machines is refused.
    assert relaunch_command(tmp_path, {"distributed_type": "NO", "num_processes": 1}, [], None, config) is None
    with pytest.raises(UsageError, match="ran on 2 machines; resume it the way it was launched"):
        relaunch_command(tmp_path, {**RECORDED, "num_machines": 2}, [], None, config)


def test_a_relaunch_uses_the_recorded_deepspeed_json_not_the_file(tmp_path):
    """A DeepSpeed run records the JSON its accelerate config named; the
    relaunch points the recorded config at a copy of that content."""
    from pathlib import Path

    import yaml

    from finetune.launch import write_recorded_configs

    settings = {"zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}
    launch = {**RECORDED, "accelerate_config": {"distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_config_file": "gone/zero3.json", "zero3_init_flag": False}}, "deepspeed_config": settings}
    config = yaml.safe_load(write_recorded_configs(launch, tmp_path).read_text())
    named = Path(config["deepspeed_config"]["deepspeed_config_file"])
    assert named.parent == tmp_path and json.loads(named.read_text()) == settings
    assert config["deepspeed_config"]["zero3_init_flag"] is False and config["distributed_type"] == "DEEPSPEED"
    assert yaml.safe_load(write_recorded_configs(RECORDED, tmp_path).read_text()) == RECORDED["accelerate_config"]


@pytest.mark.parametrize("left, launcher_code, expected", [
    ({}, 0, 0),                              # nothing failed
    ({0: 2, 1: 2}, 1, 2),                    # bad input every rank found: the workers' code, not the launcher's 1
    ({0: 0, 1: 130}, 1, 130),                # rank 1 stopped by a signal
    ({1: 2}, 1, 2),                          # rank 0 died without a word
    ({}, 1, 1),                              # no rank left a code: the launcher's
])
def test_a_relaunch_exits_with_the_workers_code(tmp_path, left, launcher_code, expected):
    from finetune.launch import workers_exit_code

    for rank, code in left.items():
        (tmp_path / f"rank{rank}").write_text(str(code))
    assert workers_exit_code(tmp_path, launcher_code) == expected
