"""Unit tests of the device mesh a launch asks for."""

from __future__ import annotations

import pytest

from finetune.errors import UsageError

MESH_ENV = {"dp_replicate_size": "1", "dp_shard_size": "1", "tp_size": "1", "cp_size": "1", "sp_size": "1"}


@pytest.mark.parametrize("sizes, world, dims, problem", [
    ({"dp_replicate_size": "2", "dp_shard_size": "2"}, 2, {"dp_replicate", "dp_shard"}, "= 4 ranks, but 2 were launched"),
    ({"dp_replicate_size": "2"}, 2, {"dp_replicate", "dp_shard"}, "leaves FSDP nothing to shard over"),
    ({"tp_size": "2"}, 2, {"dp_replicate", "dp_shard", "tp"}, "tensor parallelism runs under FSDP here"),
    ({"tp_size": "2"}, 2, {"dp_replicate", "dp_shard"}, "asks for tp 2, which this launch's backend (DDP)"),
    ({"dp_shard_size": "2", "cp_size": "2"}, 4, {"dp_replicate", "dp_shard"}, "asks for context parallelism"),
    ({"sp_size": "2"}, 2, {"dp_replicate", "dp_shard"}, "asks for sequence parallelism"),
    ({"dp_replicate_size": "2", "dp_shard_size": "2"}, 4, set(), "backend (DDP) does not lay a model out on"),
    ({"dp_shard_size": "two"}, 2, {"dp_shard"}, "'two' is not a positive number of ranks"),
])
def test_a_mesh_the_run_cannot_have_is_refused_in_one_line(monkeypatch, sizes, world, dims, problem):
    from finetune.backends.mesh import check_requested_mesh

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for name, value in {**MESH_ENV, **sizes}.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{name.upper()}", value)
    with pytest.raises(UsageError) as refused:
        check_requested_mesh(world, frozenset(dims), "DDP", on_gpu=False)
    message = str(refused.value)
    assert problem in message and "\n" not in message
    # ...and the mesh it can have passes.
    for mesh in ({"dp_replicate_size": "2", "dp_shard_size": "2"}, {"dp_shard_size": "2", "tp_size": "2"}):
        for name, value in {**MESH_ENV, **mesh}.items():
            monkeypatch.setenv(f"PARALLELISM_CONFIG_{name.upper()}", value)
        check_requested_mesh(4, frozenset({"dp_replicate", "dp_shard", "tp"}), "FSDP2", on_gpu=False)


def test_a_config_s_mesh_size_that_is_not_a_number_is_one_line(tmp_path):
    from conftest import run_in_process

    config = tmp_path / "bad.yaml"
    config.write_text("distributed_type: FSDP\nparallelism_config:\n  parallelism_config_dp_replicate_size: two\n")
    proc = run_in_process("estimate-memory", "--model", "tiny-gpt2", "--accelerate_config", config)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "parallelism_config_dp_replicate_size: 'two' is not a positive number of ranks" in proc.stderr
