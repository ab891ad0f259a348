"""Every accelerate config: what the CPU can run trains, checkpoints, resumes and
exports with the expected sharding; what it cannot is refused in one line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import CONFIGS, REPO, ForkServer, check_ok, common_args, free_port, run_cli, run_cli_together, run_in_process, train_rows
from e2e.test_errors import children_cpu_seconds

pytestmark = pytest.mark.slow


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("config, nproc, expected_type, sharded", [
    ("fsdp_shard_grad_op.yaml", 2, "FSDP", True),
    ("ddp.yaml", 2, "MULTI_CPU", False),
])
def test_config_trains_checkpoints_resumes_and_exports(config, nproc, expected_type, sharded, checkpointed_run,
                                                       tmp_path, env, small_corpus):
    run_dir = tmp_path / "run"
    args = common_args(small_corpus)
    check_ok(run_cli(["train", *args, "--max_steps", "2", "--checkpoint_every", "2", "--output_dir", str(run_dir)],
                     env, nproc=nproc, config=config, mixed_precision="no", warm=True))
    assert (run_dir / "checkpoints" / "step_000002").is_dir()
    check_ok(run_cli(["resume", str(run_dir), "--max_steps", "3"], env, nproc=nproc, config=config,
                     mixed_precision="no", warm=True))

    facts = summary(run_dir)
    assert facts["distributed_type"] == expected_type and facts["world_size"] == nproc
    total, local = facts["total_params"], facts["local_params_per_rank"]
    if sharded:
        assert sum(local) == total and all(abs(n - total / nproc) <= 0.01 * total for n in local)
        shards = run_dir / "checkpoints" / "step_000003" / "pytorch_model_fsdp_0"
        assert len(list(shards.glob("*.distcp"))) == nproc
    else:
        assert local == [total] * nproc  # full replicas
    assert facts["state_bytes_per_rank"] == [16 * n for n in local]  # fp32 params, grads, AdamW moments

    # The losses of steps 1-3 only depend on the LRs of steps 1-2, which are the
    # same for 3 and 12 steps: every config must match the 12-step FSDP run.
    reference = {r["step"]: r["loss"] for r in train_rows(checkpointed_run)}
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["loss"] == pytest.approx(reference[row["step"]], abs=1e-5), (config, row["step"])

    out = tmp_path / "exported"
    check_ok(run_in_process("export", run_dir, "--output", out))
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() == total


def test_activation_checkpointing_same_losses_less_memory(tmp_path, env, small_corpus):
    """Larger activations (8 x 256 tokens per rank, 4 layers), so that the
    difference shows in the bytes torch's allocator holds for a training step,
    on every rank (the profiler's accounting of the third step: process RSS
    mixes in tokenizer training, evaluation and the final save). The
    checkpointed model's checkpoint then resumes (its parameter names carry the wrapper)."""
    args = ["--model", "small-gpt2", "--dataset", str(small_corpus), "--block_size", "256",
            "--per_device_batch_size", "8", "--max_steps", "3", "--sample_prompt", "", "--max_eval_batches", "1",
            "--checkpoint_every", "3", "--profile_steps", "1"]
    runs = {config: tmp_path / config for config in ("fsdp.yaml", "fsdp_activation_checkpointing.yaml")}
    for proc in run_cli_together([(["train", *args, "--output_dir", str(run_dir)],
                                   {"config": config, "mixed_precision": "no"}) for config, run_dir in runs.items()], env):
        check_ok(proc)
    plain, checkpointed = (train_rows(runs[c]) for c in runs)
    assert [r["loss"] for r in checkpointed] == pytest.approx([r["loss"] for r in plain], abs=1e-6)

    def step_peaks(run_dir):
        return [json.loads((run_dir / "profile" / f"rank{r}_breakdown.json").read_text())["peak_step_allocation_bytes"]
                for r in range(2)]

    plain_peak, ac_peak = step_peaks(runs["fsdp.yaml"]), step_peaks(runs["fsdp_activation_checkpointing.yaml"])
    assert all(ac < plain for ac, plain in zip(ac_peak, plain_peak)), (ac_peak, plain_peak)

    ac_run = runs["fsdp_activation_checkpointing.yaml"]
    check_ok(run_cli(["resume", str(ac_run), "--max_steps", "4"], env, config="fsdp_activation_checkpointing.yaml",
                     mixed_precision="no", warm=True))
    assert [r["step"] for r in train_rows(ac_run)] == [1, 2, 3, 4] and summary(ac_run)["distributed_type"] == "FSDP"


# Where each shipped config is launched exactly as its header documents it. The
# test below runs those with a `[OPTIONS]` line; the others are run so elsewhere.
DOCUMENTED_ELSEWHERE = {
    "fsdp.yaml": "test_docs (the docs' commands, as written)",
    "fsdp_cnn.yaml": "test_cnn (the docs' CNN command)",
    "multinode.yaml": "test_multinode_on_one_machine",
    "tp.yaml": "test_parallelism's test_tp_yaml_runs_as_its_header_documents (a Llama: GPT-2 has no tensor-parallel plan)",
    "zero1.yaml": "test_deepspeed's zero_runs", "zero2.yaml": "test_deepspeed's zero_runs",
    "zero3.yaml": "test_deepspeed's zero_runs",
}
GPU_ONLY = {"fsdp1.yaml": "fsdp_version: 1 (FSDP1) needs a GPU",
            "fsdp_offload.yaml": "fsdp_offload_params: true (CPU offload) needs a GPU"}


def documented_launch(config: str) -> list[str]:
    """The `accelerate launch` line of the config's header comment, as words."""
    header = [line[1:].strip() for line in (CONFIGS / config).read_text().splitlines() if line.startswith("#")]
    lines = [line for line in header if line.startswith(f"accelerate launch --config_file accelerate_configs/{config}")]
    assert len(lines) == 1, f"{config}: its header documents {len(lines)} launch lines"
    return lines[0].split()


def test_every_config_is_launched_as_documented():
    shipped = {p.name for p in CONFIGS.glob("*.yaml")}
    documented_here = {config for config in shipped if "[OPTIONS]" in (CONFIGS / config).read_text()}
    assert shipped == documented_here | set(DOCUMENTED_ELSEWHERE), shipped ^ (documented_here | set(DOCUMENTED_ELSEWHERE))


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml") if p.name not in DOCUMENTED_ELSEWHERE))
def test_config_runs_as_its_header_documents(config, tmp_path, env, small_corpus):
    """The header's command, [OPTIONS] filled in, nothing else added but a free
    port: the config's own precision (bf16 for most, on any CPU) and process
    count, through accelerate's own launch (the ranks forked from the tests'
    fork server: what launching itself does is test_fork_server's and
    test_multinode_on_one_machine's). A GPU-only config is launched afresh: it
    stops every rank with the same line on a CPU machine, at a launch's cost."""
    words = documented_launch(config)
    assert words[-1] == "[OPTIONS]"
    run_dir = tmp_path / "run"
    command = [*words[:-1], *common_args(small_corpus), "--max_steps", "2", "--output_dir", str(run_dir)]
    gpu_only = config in GPU_ONLY and not torch.cuda.is_available()
    if gpu_only or ForkServer.imports_differ(env):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()),
               *command[2:]]
        cpu_start = children_cpu_seconds()
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    else:
        proc = ForkServer.run_launch_line(command, env, 300)
    settings = yaml.safe_load((CONFIGS / config).read_text())
    if gpu_only:
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert errors and GPU_ONLY[config] in errors[0], proc.stderr[-2000:]
        assert not run_dir.exists()
        # Refused with torch alone loaded (~2 CPU-s a rank, not ~6-10 with transformers and datasets), beside
        # the launcher's ~2: the bound holds on a slow CPU (tests/unit/test_preflight.py checks what loaded).
        cpu_seconds = children_cpu_seconds() - cpu_start
        assert cpu_seconds < 12, cpu_seconds
        return
    check_ok(proc)
    facts = summary(run_dir)
    assert facts["mixed_precision"] == settings.get("mixed_precision", "no")
    assert facts["world_size"] == settings["num_processes"] and facts["steps"] == 2
    assert all(math.isfinite(r["loss"]) for r in train_rows(run_dir))
    total, local = facts["total_params"], facts["local_params_per_rank"]
    if settings["distributed_type"] == "FSDP":
        # Each replica's ranks hold the whole model between them (one replica but under HSDP).
        mesh = settings.get("parallelism_config", {})
        replicas, shards = (mesh.get(f"parallelism_config_dp_{d}_size", 1) for d in ("replicate", "shard"))
        assert facts["parallelism"] == {"dp_replicate": replicas, "dp_shard": shards if mesh else len(local), "tp": 1}
        assert facts["distributed_type"] == "FSDP" and sum(local) == replicas * total and max(local) < total
    else:
        assert local == [total] * settings["num_processes"]


def test_multinode_on_one_machine(tmp_path, env, small_corpus):
    """Two `accelerate launch` commands, machine ranks 0 and 1, two processes each:
    one HSDP job, a replica on each "machine" sharded over its two ranks."""
    run_dir = tmp_path / "run"
    port = str(free_port())
    procs = []
    for machine_rank in ("0", "1"):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "multinode.yaml"),
               "--num_machines", "2", "--machine_rank", machine_rank, "--main_process_ip", "127.0.0.1",
               "--main_process_port", port, "--num_processes", "4",
               "-m", "finetune", "train", *common_args(small_corpus), "--max_steps", "3",
               "--output_dir", str(run_dir)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    facts = summary(run_dir)
    assert facts["distributed_type"] == "FSDP" and facts["world_size"] == 4
    assert facts["parallelism"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1}
    assert facts["mixed_precision"] == "bf16"  # the config's own, as documented
    local, total = facts["local_params_per_rank"], facts["total_params"]
    assert sum(local[:2]) == sum(local[2:]) == total and max(local) < 0.6 * total  # each machine holds one replica
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "step_000003" / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert shards == [f"__{rank}_0.distcp" for rank in range(4)]
