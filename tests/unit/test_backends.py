"""Unit tests of the backends: what each imports and checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # a fresh interpreter of its own (what it imports): not the quick tier's
@pytest.mark.parametrize("deepspeed_run", [False, True])
def test_only_a_deepspeed_run_imports_deepspeed_when_accelerate_unwraps(deepspeed_run):
    pytest.importorskip("deepspeed")
    script = """
import sys
import torch
from accelerate.utils import extract_model_from_parallel
from finetune.backends import requested_backend
requested_backend().import_libraries()
extract_model_from_parallel(torch.nn.Linear(2, 2))  # what Accelerate's prepare and unwrap_model call
print("deepspeed" in sys.modules)
"""
    env = {**os.environ, "ACCELERATE_USE_DEEPSPEED": "true" if deepspeed_run else "false"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == str(deepspeed_run)


def test_shards_that_do_not_partition_the_model_stop_the_run():
    """Each rank holding everything (a silent fallback) is refused; padded ZeRO-3 partitions are not."""
    from finetune.backends.base import ShardReport, check_partition
    from finetune.errors import NotDistributed

    check_partition(ShardReport(total_params=100, local_params_per_rank=[52, 52]), "ZeRO-3 partitions")
    for per_rank in ([100, 100], [50, 40]):
        with pytest.raises(NotDistributed, match="do not partition the model.*refusing to train unsharded"):
            check_partition(ShardReport(total_params=100, local_params_per_rank=per_rank), "FSDP shards")
