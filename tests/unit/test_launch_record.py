"""Unit tests of what `finetune resume` replays of a run's launch record (finetune/launch_record.py)."""

from __future__ import annotations

import pytest

from finetune.errors import UsageError
from finetune.launch_record import checked_record

RECORDED = {"distributed_type": "DEEPSPEED", "num_processes": 2, "num_machines": 1,
            "launcher_options": ["--num_processes", "2"],
            "accelerate_config": {"distributed_type": "DEEPSPEED", "num_processes": 2,
                                  "deepspeed_config": {"deepspeed_config_file": "/elsewhere/monitor.json"}}}


def test_a_deepspeed_file_the_record_names_is_replayed_only_from_the_content_it_holds(tmp_path):
    """The file a recorded accelerate config names may be anything by now
    (DeepSpeed's monitors write where their JSON says): only the JSON the
    record holds, itself checked, stands in for it."""
    with pytest.raises(UsageError, match=r"names a DeepSpeed config file \(/elsewhere/monitor.json\) without "
                                         "holding its content"):
        checked_record(RECORDED, tmp_path)
    held = {**RECORDED, "deepspeed_config": {"zero_optimization": {"stage": 2}}}
    assert checked_record(held, tmp_path)["deepspeed_config"] == held["deepspeed_config"]
    with pytest.raises(UsageError, match="writes files of its own"):
        checked_record({**RECORDED, "deepspeed_config": {"tensorboard": {"enabled": True}}}, tmp_path)
