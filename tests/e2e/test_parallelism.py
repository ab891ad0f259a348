"""Past flat FSDP, on 4 CPU processes over gloo, checked from the outside.

HSDP (hsdp.yaml): the losses of flat FSDP on the same 4 ranks, each rank holding
half the model, each replica's ranks all of it, the checkpoint storing it once,
checkpoints resuming across the two layouts, the export flat FSDP's weights. Tensor parallel under FSDP (tp.yaml): one
process's losses with the same global batch, checkpoints resuming across it and
flat FSDP, its export the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import check_ok, common_args, dcp_elements_per_file, run_cli, run_cli_together, run_in_process, train_rows

pytestmark = pytest.mark.slow


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def planned_state(model: str, mesh: tuple[int, int, int]) -> int:
    """`finetune estimate-memory`'s parameters, gradients and AdamW state per rank for `mesh`."""
    from finetune.memory import estimate, model_shape

    rows = estimate(model_shape(model), 4, 4, 64, mixed_precision="no", meshes=(mesh,))
    return next(e.state for e in rows if e.mesh == mesh and "checkpointing" not in e.strategy)


def test_hsdp_trains_as_fsdp_does_on_half_the_model_per_rank_and_resumes_under_fsdp(tmp_path, env, small_corpus):
    args = [*common_args(small_corpus), "--max_steps", "4", "--checkpoint_every", "2"]
    runs = {config: tmp_path / config for config in ("fsdp.yaml", "hsdp.yaml")}
    for proc in run_cli_together([(["train", *args, "--output_dir", str(run_dir)],
                                   {"config": config, "nproc": 4, "mixed_precision": "no"})
                                  for config, run_dir in runs.items()], env):
        check_ok(proc)
    flat, hybrid = (summary(runs[c]) for c in runs)
    assert flat["parallelism"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 1}
    assert hybrid["parallelism"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1}

    # The same global batch (4 ranks x 4) and the same averaged gradient: the same losses.
    flat_losses = [r["loss"] for r in train_rows(runs["fsdp.yaml"])]
    hybrid_losses = [r["loss"] for r in train_rows(runs["hsdp.yaml"])]
    assert len(hybrid_losses) == 4 and hybrid_losses == pytest.approx(flat_losses, abs=1e-5)

    # Flat: a quarter each. HSDP: ranks 0-1 and 2-3 each hold the whole model, half of it each.
    total = hybrid["total_params"]
    assert sum(flat["local_params_per_rank"]) == total and max(flat["local_params_per_rank"]) < 0.3 * total
    local = hybrid["local_params_per_rank"]
    assert sum(local[:2]) == sum(local[2:]) == total
    assert all(abs(n - total / 2) <= 0.02 * total for n in local), local
    assert planned_state("tiny-gpt2", (2, 2, 1)) == max(hybrid["state_bytes_per_rank"])
    # Replicated shards are stored once, spread over the replicas' files.
    checkpoint = runs["hsdp.yaml"] / "checkpoints" / "step_000002"
    stored = dcp_elements_per_file(checkpoint / "pytorch_model_fsdp_0", skip=set())
    assert len(stored) == 4 and sum(stored.values()) == total, stored

    # The HSDP checkpoint of step 2 continues under flat FSDP on 2 ranks of 8
    # (the same global batch of 16): steps 3 and 4 as the HSDP run had them.
    resumed = tmp_path / "resumed"
    proc = run_cli(["train", *args, "--per_device_batch_size", "8", "--resume_from_checkpoint", str(checkpoint),
                    "--output_dir", str(resumed)], env, nproc=2, mixed_precision="no", warm=True)
    check_ok(proc)
    assert "checkpoint written by 4 rank(s), resuming on 2" in proc.stdout
    assert summary(resumed)["parallelism"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1}
    rows = train_rows(resumed)
    assert [r["step"] for r in rows] == [3, 4]
    assert [r["loss"] for r in rows] == pytest.approx(hybrid_losses[2:], abs=1e-5)

    # Exported whole: the weights flat FSDP ended with.
    from safetensors.torch import load_file

    check_ok(run_in_process("export", runs["hsdp.yaml"], "--output", tmp_path / "exported"))
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    flat_final = load_file(runs["fsdp.yaml"] / "final" / "model.safetensors")
    assert exported.keys() == flat_final.keys()
    assert max((exported[k] - flat_final[k]).abs().max().item() for k in exported) < 1e-5

    # ... and the reverse: flat FSDP's checkpoint of step 2 continues as HSDP.
    rehybrid = tmp_path / "rehybrid"
    check_ok(run_cli(["train", *args, "--resume_from_checkpoint", str(runs["fsdp.yaml"] / "checkpoints" / "step_000002"),
                      "--output_dir", str(rehybrid)], env, nproc=4, config="hsdp.yaml", mixed_precision="no", warm=True))
    assert summary(rehybrid)["parallelism"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1}
    assert [r["loss"] for r in train_rows(rehybrid)] == pytest.approx(flat_losses[2:], abs=1e-5)


def test_a_mesh_that_does_not_fit_the_launch_stops_in_one_line(tmp_path, env, small_corpus):
    """hsdp.yaml's 2 x 2 mesh on 2 processes: every rank stops before its process
    group with the same line, and no run dir is made."""
    run_dir = tmp_path / "run"
    proc = run_cli(["train", *common_args(small_corpus), "--max_steps", "1", "--output_dir", str(run_dir)], env,
                   nproc=2, config="hsdp.yaml", mixed_precision="no")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and all(e == errors[0] for e in errors), proc.stderr[-2000:]
    assert "2 x dp_shard 2 x tp 1 = 4 ranks, but 2 were launched" in errors[0]
    assert "Traceback" not in "\n".join(line for line in proc.stderr.splitlines() if "[rank" in line)
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama (4 heads, 2 KV heads): a family transformers has a tensor-parallel plan for."""
    from sft_models import save_chat_model

    return save_chat_model(tmp_path_factory.mktemp("llama") / "model")


def llama_args(model: Path, corpus: Path) -> list[str]:
    return ["--model", str(model), "--dataset", str(corpus), "--block_size", "64", "--sample_prompt", "",
            "--max_eval_batches", "1", "--learning_rate", "3e-3"]


def test_tensor_parallel_gives_one_process_losses_resumes_under_fsdp_and_exports(tmp_path, env, small_corpus,
                                                                                   llama_dir):
    """tp.yaml (2 shards x tensor parallel 2) on 4 processes against one process
    with the same global batch (2 data-parallel ranks x 4 = 8)."""
    args = [*llama_args(llama_dir, small_corpus), "--max_steps", "4", "--checkpoint_every", "2"]
    runs = {"tp.yaml": tmp_path / "tp", "single.yaml": tmp_path / "one"}
    for proc in run_cli_together([
            (["train", *args, "--per_device_batch_size", "4", "--output_dir", str(runs["tp.yaml"])],
             {"config": "tp.yaml", "nproc": 4, "mixed_precision": "no"}),
            (["train", *args, "--per_device_batch_size", "8", "--output_dir", str(runs["single.yaml"])],
             {"config": "single.yaml", "nproc": 1, "mixed_precision": "no"})], env):
        check_ok(proc)
    split, whole = summary(runs["tp.yaml"]), summary(runs["single.yaml"])
    assert split["parallelism"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    split_losses = [r["loss"] for r in train_rows(runs["tp.yaml"])]
    assert len(split_losses) == 4
    assert split_losses == pytest.approx([r["loss"] for r in train_rows(runs["single.yaml"])], abs=1e-4)
    assert split["last_eval"]["eval_loss"] == pytest.approx(whole["last_eval"]["eval_loss"], abs=1e-4)
    # Every rank holds about a quarter: the split matrices over 4, the replicated norms over 2.
    total, local = split["total_params"], split["local_params_per_rank"]
    assert total == whole["total_params"] and sum(local) >= total and max(local) < 0.3 * total, local

    # The planner's row for this mesh, against what each rank held (its replicated norms are counted as split).
    planned = planned_state(str(llama_dir), (1, 2, 2))
    assert all(abs(planned / measured - 1) < 0.02 for measured in split["state_bytes_per_rank"])

    # Its checkpoint of step 2 continues under flat FSDP on 2 ranks (the same global batch of 8).
    checkpoint = runs["tp.yaml"] / "checkpoints" / "step_000002"
    resumed = tmp_path / "resumed"
    check_ok(run_cli(["train", *args, "--per_device_batch_size", "4", "--checkpoint_every", "1",
                      "--resume_from_checkpoint", str(checkpoint), "--output_dir", str(resumed)],
                     env, nproc=2, mixed_precision="no", warm=True))
    assert summary(resumed)["parallelism"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1}
    assert [r["loss"] for r in train_rows(resumed)] == pytest.approx(split_losses[2:], abs=1e-4)
    # ... and the reverse: flat FSDP's checkpoint of step 3 continues split again.
    resplit = tmp_path / "resplit"
    check_ok(run_cli(["train", *args, "--per_device_batch_size", "4", "--resume_from_checkpoint",
                      str(resumed / "checkpoints" / "step_000003"), "--output_dir", str(resplit)],
                     env, nproc=4, config="tp.yaml", mixed_precision="no", warm=True))
    assert [r["loss"] for r in train_rows(resplit)] == pytest.approx(split_losses[3:], abs=1e-4)

    # Exported whole: the same weights as the one-process run's.
    from safetensors.torch import load_file

    check_ok(run_in_process("export", runs["tp.yaml"], "--output", tmp_path / "exported"))
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    reference = load_file(runs["single.yaml"] / "final" / "model.safetensors")
    assert exported.keys() == reference.keys()
    assert max((exported[k] - reference[k]).abs().max().item() for k in exported) < 1e-4


def test_tp_yaml_runs_as_its_header_documents(tmp_path, env, small_corpus, llama_dir):
    """Its own processes (4) and precision (bf16), on a Llama; GPT-2, without a
    tensor-parallel plan, is refused on every rank in one line."""
    run_dir = tmp_path / "run"
    check_ok(run_cli(["train", *llama_args(llama_dir, small_corpus), "--per_device_batch_size", "4", "--max_steps",
                      "2", "--output_dir", str(run_dir)], env, nproc=4, config="tp.yaml"))
    facts = summary(run_dir)
    assert facts["mixed_precision"] == "bf16" and facts["world_size"] == 4 and facts["steps"] == 2
    assert facts["parallelism"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}

    # Refused on 4 forked ranks: a run, not a launch.
    refused = run_cli(["train", *common_args(small_corpus), "--max_steps", "1", "--output_dir", str(tmp_path / "gpt2")],
                      env, nproc=4, config="tp.yaml", mixed_precision="no", warm=True)
    assert refused.returncode != 0
    errors = {line for line in refused.stderr.splitlines() if line.startswith("error:")}
    assert len(errors) == 1 and "has no tensor-parallel plan in transformers" in errors.pop(), refused.stderr[-2000:]
