"""Library internals finetune still relies on (README, "Library internals"),
each checked here or in the named test so that a library upgrade that removes
one fails loudly instead of silently changing what a run does."""

from __future__ import annotations

import pytest
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
# Accelerate selects FSDP on a CPU-only machine (finetune/backends/fsdp.py), is the
# product's core trick. Every multi-process FSDP run checks from the outside that
# it still shards: tests/e2e/test_fsdp_train.py::test_summary_reports_real_fsdp_shards
# and ::test_checkpoint_holds_one_shard_file_per_rank_matching_summary, and verify_sharded stops any
# run that asked for FSDP and did not get it.


# Accelerate's unwrap imports DeepSpeed whenever it is installed; runs that do
# not use it tell `accelerate.utils.other` otherwise (finetune/backends/base.py):
# tests/unit/test_backends.py::test_only_a_deepspeed_run_imports_deepspeed_when_accelerate_unwraps.

GLOO_COLLECTIVES = """
import os
import sys
import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from finetune import collectives
from finetune.collectives import GlooAllGather, GlooReduceScatter, use_gloo_collectives

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
collectives.GLOO_ALL_GATHER_PIECE_BYTES = 4096  # several pieces even for small tensors
for dtype in (torch.float32, torch.bfloat16):
    for n in (1, 7, 1000, 12345):  # per rank: less than a piece, and several pieces with a remainder
        mine = torch.randn(n, generator=torch.Generator().manual_seed(rank * 100 + n)).to(dtype)
        expected = torch.empty(n * world, dtype=dtype)
        dist.all_gather_into_tensor(expected, mine)
        output = GlooAllGather().allocate((n * world,), dtype=dtype, device=torch.device("cpu"))
        output[rank * n:(rank + 1) * n] = mine  # FSDP2's input is this view of its output
        assert GlooAllGather()(output, output[rank * n:(rank + 1) * n], dist.group.WORLD, async_op=True) is None
        assert torch.equal(output, expected), (dtype, n)
        grads = torch.randn(n * world, generator=torch.Generator().manual_seed(rank)).to(dtype)
        expected = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(expected, grads.clone())
        output = torch.empty(n, dtype=dtype)
        GlooReduceScatter()(output, grads.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
        assert torch.allclose(output.float(), expected.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6), (dtype, n)

# Through FSDP2's own calls: the same gradients as its default collectives, and ours were the ones used.
calls = {"all_gather": 0, "reduce_scatter": 0}
for cls, name in ((GlooAllGather, "all_gather"), (GlooReduceScatter, "reduce_scatter")):
    original = cls.__call__
    def counted(self, *args, _original=original, _name=name, **kwargs):
        calls[_name] += 1
        return _original(self, *args, **kwargs)
    cls.__call__ = counted
grads = []
for custom in (False, True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.GELU(), torch.nn.Linear(300, 64))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    if custom:
        use_gloo_collectives(model)
    torch.manual_seed(1 + rank)
    model(torch.randn(8, 64)).square().sum().backward()
    grads.append([p.grad.to_local().clone() for p in model.parameters()])
assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(*grads))
assert calls["all_gather"] >= 4 and calls["reduce_scatter"] >= 2, calls  # 2 units: forward and backward gathers
dist.destroy_process_group()
print("ok", calls, flush=True)
# As the finetune command ends (cli.entry): without the interpreter's teardown, in which gloo's
# worker threads sometimes abort the process ("terminate called without an active exception").
os._exit(0)
"""


@pytest.mark.slow
def test_fsdp2_takes_our_gloo_collectives_and_they_equal_gloos_own(tmp_path, env):
    """FSDPModule.set_custom_all_gather / set_custom_reduce_scatter and the comm
    interface they call (`allocate`, then the call with FSDP2's arguments)."""
    import subprocess
    import sys

    from conftest import check_ok, free_port

    script = tmp_path / "collectives.py"
    script.write_text(GLOO_COLLECTIVES)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3",
                           "--master_port", str(free_port()), str(script)],
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    check_ok(proc)
    assert proc.stdout.count("ok") == 3
