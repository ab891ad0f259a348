"""Library internals finetune still relies on (README, "Library internals"),
each checked here or in the named test so that a library upgrade that removes
one fails loudly instead of silently changing what a run does."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from finetune.profiling import peak_step_allocation_bytes


def test_profiler_still_records_every_allocation_for_the_step_peak():
    """`prof.profiler.kineto_results`: CPU torch has no max_memory_allocated, and
    the public event list attributes memory to operators, not to a timeline."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        first = torch.ones(1_000_000)   # 4 MB
        second = torch.ones(2_000_000)  # 8 MB, both alive at once
        del first, second
        torch.ones(1_000_000)           # 4 MB after both were freed
    assert 12_000_000 <= peak_step_allocation_bytes(prof) < 16_000_000


# `PartialState.distributed_type`, switched while the Accelerator is built so that
# Accelerate selects FSDP on a CPU-only machine (finetune/distributed.py), is the
# product's core trick. Every multi-process FSDP run checks from the outside that
# it still shards: tests/test_fsdp_train.py::test_summary_reports_real_fsdp_shards
# and ::test_checkpoint_holds_one_shard_file_per_rank_matching_summary, and verify_sharded stops any
# run that asked for FSDP and did not get it.
