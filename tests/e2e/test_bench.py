"""scripts/bench.py's smallest quick case and gpu_bench.sh's smoke run, so the benchmarks cannot rot. (The
figures themselves come from full runs of the script, not from tests.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, check_ok

pytestmark = pytest.mark.slow


def test_bench_quick_smallest_case(tmp_path, env, small_corpus):
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--quick", "--suite", "configs", "--only", "single", "--profile",
                           "--dataset", str(small_corpus), "--block_size", "64", "--output_dir", str(tmp_path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    check_ok(proc)
    [result] = json.loads((tmp_path / "configs.json").read_text())["results"]
    assert result["config"] == "single.yaml" and result["world_size"] == 1
    # fp32 parameters, gradients and two AdamW moments: 16 bytes per parameter, nothing else.
    assert result["state_bytes_per_rank"] == [16 * result["total_params"]]
    assert result["step_time_s"] > 0 and result["peak_memory_bytes_per_rank"][0] > 0
    assert 0 < result["mfu"] < 1
    table = (tmp_path / "configs.md").read_text()
    assert "| single.yaml | NO | 1 |" in table and "matmul peak per core" in table
    # The profiled run's breakdown: every phase counted once, within the step.
    phases = result["profile_ms_per_step"]
    assert phases["forward_backward_compute"] > 0 and phases["optimizer_step"] > 0 and phases["data_loading"] > 0
    assert phases["fsdp_all_gather"] == phases["fsdp_reduce_scatter"] == 0  # one process: no collectives
    assert all(ms >= 0 for ms in phases.values())
    assert sum(ms for name, ms in phases.items() if name != "step") == pytest.approx(phases["step"])
    assert "| single.yaml | " in table.split("where the step time goes")[1]
    # Torch's own accounting of a step's transient memory: more than the fp32
    # gradients alone (activations come on top), less than the whole resident set.
    assert 4 * result["total_params"] < result["profile_peak_step_allocation_bytes"] < result["peak_memory_bytes_per_rank"][0]


def test_gpu_bench_smoke_runs_every_code_path_a_cpu_can(tmp_path, env):
    """`bash scripts/gpu_bench.sh --smoke`: the GPU benchmark's driver, our
    dense-mask runs (full and LoRA), TRL's SFTTrainer and GRPO's replica on a tiny model, so
    the script cannot rot between the sessions that have a GPU; the cases a
    CPU cannot run are rows that say why."""
    proc = subprocess.run(["bash", "scripts/gpu_bench.sh", "--smoke", "--output_dir", str(tmp_path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    check_ok(proc)
    results = {r["case"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    ran = [results["full, dense mask (sdpa)"], results["LoRA r=16, dense mask (sdpa)"],
           results["TRL SFTTrainer, padding_free"]]
    for result in ran:
        assert "failed" not in result, result
        assert result["tokens_per_sec"] > 0 and result["peak_memory_bytes"] > 0
    # The same model and data, the loss on every token: the first steps' losses agree (near ln of the vocabulary).
    losses = [result["loss"] for result in ran]
    assert max(losses) - min(losses) < 0.1 * min(losses), losses
    for case in ("full, flex attention", "full, varlen (flash-attention)", "full, flex + Liger", "QLoRA r=16, flex attention"):
        assert results[case]["failed"] == "skipped: needs a CUDA GPU"
    grpo = results.pop("GRPO, replica")  # GRPO's driver: our replica engine runs, the vLLM rows say why not
    assert "failed" not in grpo and grpo["step_time_s"] > 0 and 0 < grpo["rollout_time"] < grpo["step_time_s"], grpo
    for case in ("GRPO, vllm colocate", "TRL GRPOTrainer, vllm colocate"):
        assert results.pop(case)["failed"] == "skipped: needs a CUDA GPU"
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n| tiny Llama | 128 |") == len(results) == 8
    assert table.count("\n| GRPO, ") == 2 and "\n| TRL GRPOTrainer, vllm colocate | skipped" in table
