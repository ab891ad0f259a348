"""DeepSpeed ZeRO-1/2/3 through the same `accelerate launch`, on 2 CPU
processes over gloo: what each stage partitions (from the engine and from its
checkpoint files), the same losses as FSDP and one process, exact resume,
and an export equal to the end-of-run model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import check_ok, common_args, launches, run_cli, run_cli_together, run_in_process, train_rows
from e2e.test_errors import one_error_line, snapshot
from e2e.test_resume import interrupted_copy

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

STEPS, CHECKPOINT_AT = 5, 3
# 16 samples per optimizer step either way: 2 ranks x 4 x 2 micro-batches, or 1 process x 4 x 4.
TWO_RANKS = ["--max_steps", str(STEPS), "--gradient_accumulation_steps", "2", "--checkpoint_every", str(CHECKPOINT_AT)]
ONE_PROCESS = ["--max_steps", str(STEPS), "--gradient_accumulation_steps", "4"]
BYTES_PER_OPTIMIZED_ELEMENT = 12  # fp32 master, exp_avg and exp_avg_sq


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
@launches
def zero_runs(tmp_path_factory, env, small_corpus) -> dict[int, Path]:
    """One run per stage, launched as the config's header documents it (its default precision: fp32),
    5 steps with 2 micro-batches each, a checkpoint at step 3 and at the end."""
    runs = {stage: tmp_path_factory.mktemp(f"zero{stage}") / "run" for stage in (1, 2, 3)}
    procs = run_cli_together([(["train", *common_args(small_corpus), *TWO_RANKS, "--output_dir", str(run_dir)],
                               {"config": f"zero{stage}.yaml"}) for stage, run_dir in runs.items()], env)
    for run_dir, proc in zip(runs.values(), procs):
        check_ok(proc)
        (run_dir.parent / "stdout.txt").write_text(proc.stdout)
    return runs


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_partitions_what_it_promises(zero_runs, stage):
    facts = summary(zero_runs[stage])
    assert facts["distributed_type"] == "DEEPSPEED" and facts["zero_stage"] == stage and facts["world_size"] == 2
    assert facts["mixed_precision"] == "no"  # the config's default: fp32 unless the launch line asks for bf16
    start_line = next(line for line in (zero_runs[stage].parent / "stdout.txt").read_text().splitlines()
                      if line.startswith("DEEPSPEED"))
    if stage == 3:
        assert start_line.startswith(f"DEEPSPEED ZeRO-3 on 2 process(es), {facts['total_params']:,} parameters, "
                                     f"per rank {facts['local_params_per_rank']}"), start_line
    else:
        assert start_line.startswith(f"DEEPSPEED ZeRO-{stage} on 2 process(es), each holding all "), start_line
    total = facts["total_params"]
    held = facts["state_elements_per_rank"]

    def whole(kind: str) -> bool:
        return held[kind] == [total, total]

    def halved(kind: str, per_element: int = 1) -> bool:
        # DeepSpeed pads each partition to an alignment: a little over half, never less.
        return sum(held[kind]) >= per_element * total and max(held[kind]) < 0.55 * per_element * total

    assert halved("optimizer", per_element=3)  # fp32 master + two AdamW moments, every stage
    assert whole("grads") if stage == 1 else halved("grads")
    assert whole("params") if stage < 3 else halved("params")
    assert facts["local_params_per_rank"] == held["params"]

    # From the outside: one optimizer-state file per rank, each with about half of the fp32 state.
    files = zero_runs[stage] / "checkpoints" / f"step_{STEPS:06d}" / "pytorch_model"
    optimizer_files = sorted(files.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    assert [f.name[:14] for f in optimizer_files] == ["zero_pp_rank_0", "zero_pp_rank_1"]
    for f in optimizer_files:
        size = f.stat().st_size
        assert BYTES_PER_OPTIMIZED_ELEMENT * total / 2 <= size < 0.6 * BYTES_PER_OPTIMIZED_ELEMENT * total, (f, size)


def test_losses_equal_fsdp_and_one_process(zero_runs, tmp_path, env, small_corpus):
    fsdp_dir, single_dir = tmp_path / "fsdp", tmp_path / "single"
    check_ok(run_cli(["train", *common_args(small_corpus), *TWO_RANKS, "--output_dir", str(fsdp_dir)], env,
                     mixed_precision="no", warm=True))
    check_ok(run_cli(["train", *common_args(small_corpus), *ONE_PROCESS, "--output_dir", str(single_dir)], env,
                     nproc=None, warm=True))
    assert summary(fsdp_dir)["distributed_type"] == "FSDP"
    references = {"FSDP": [r["loss"] for r in train_rows(fsdp_dir)],
                  "1 process": [r["loss"] for r in train_rows(single_dir)]}
    for stage, run_dir in zero_runs.items():
        losses = [r["loss"] for r in train_rows(run_dir)]
        assert len(losses) == STEPS
        for name, reference in references.items():
            assert losses == pytest.approx(reference, abs=1e-5), (stage, name)
    assert references["FSDP"][-1] < references["FSDP"][0] - 0.1  # it trained


def tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_continues_exactly(zero_runs, tmp_path, env, stage):
    original = zero_runs[stage]
    resumed = interrupted_copy(original, CHECKPOINT_AT, tmp_path / "resumed", metrics=True)
    proc = run_cli(["resume", str(resumed)], env, config=f"zero{stage}.yaml", warm=True)
    check_ok(proc)
    assert f"resumed from {resumed / 'checkpoints' / f'step_{CHECKPOINT_AT:06d}'}" in proc.stdout
    after = {r["step"]: r["loss"] for r in train_rows(resumed)}
    expected = {r["step"]: r["loss"] for r in train_rows(original)}
    assert sorted(after) == list(range(1, STEPS + 1))
    for step in range(CHECKPOINT_AT + 1, STEPS + 1):
        assert after[step] == pytest.approx(expected[step], abs=1e-6), step
    a, b = tensors(original / "final"), tensors(resumed / "final")
    assert a.keys() == b.keys()
    assert max((a[name] - b[name]).abs().max().item() for name in a) < 1e-6


@pytest.mark.parametrize("stage", [1, 3])
def test_export_equals_the_end_of_run_model(zero_runs, tmp_path, stage):
    out = tmp_path / "exported"
    proc = run_in_process("export", zero_runs[stage], "--output", out)
    assert proc.returncode == 0, proc.stderr
    final, exported = tensors(zero_runs[stage] / "final"), tensors(out)
    assert final.keys() == exported.keys()
    for name in final:
        assert torch.equal(final[name], exported[name]), name
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)  # transformers loads it


def test_deepspeed_checkpoint_without_deepspeed(zero_runs, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(zero_runs[2], run_dir)
    before = snapshot(run_dir)
    proc = run_in_process("resume", run_dir, "--max_steps", "7", "--no_relaunch")  # one process, no DeepSpeed
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert "was written under DeepSpeed and this run is not sharded" in line and "zero2" in line, line
    assert snapshot(run_dir) == before


def test_deepspeed_checkpoint_on_another_world_size(zero_runs, tmp_path, env):
    run_dir = tmp_path / "run"
    shutil.copytree(zero_runs[2], run_dir)
    before = snapshot(run_dir)
    proc = run_cli(["resume", str(run_dir), "--max_steps", "7"], env, nproc=1, config="zero2.yaml")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "written by 2 DeepSpeed rank(s) and this run has 1" in errors[0], proc.stderr[-2000:]
    assert "--num_processes 2" in errors[0]
    # Typed in a plain shell: refused before the relaunch.
    proc = run_in_process("resume", run_dir, "--num_processes", "1")
    assert proc.returncode == 2 and "relaunching" not in proc.stdout
    assert "written by 2 DeepSpeed rank(s) and this run has 1" in one_error_line(proc.stderr)
    assert snapshot(run_dir) == before


def test_a_pickled_class_outside_deepspeeds_is_refused(zero_runs, tmp_path):
    """DeepSpeed loads its files with weights_only=False: they are checked first."""
    run_dir = tmp_path / "run"
    shutil.copytree(zero_runs[2], run_dir)
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    states = checkpoint / "pytorch_model" / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "payload": Path("/etc/passwd")}, states)  # a class no DeepSpeed file holds
    (checkpoint / "manifest.json").unlink()  # an older checkpoint's layout: nothing but the pickle check stands guard
    proc = run_in_process("export", checkpoint, "--output", tmp_path / "out", "--allow_unverified_checkpoint")
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert "mp_rank_00_model_states.pt holds more than tensors and plain values" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_memory_planner_predicts_each_stages_state(zero_runs, stage):
    from finetune.launch_configs import config_path
    from finetune.memory import estimate, model_shape, read_launch_config

    launch = read_launch_config(str(config_path(f"zero{stage}")))
    assert launch.strategy == f"DeepSpeed ZeRO-{stage}" and launch.mixed_precision == "no"
    rows = {e.strategy: e for e in estimate(model_shape("tiny-gpt2"), 2, 4, 64, mixed_precision=launch.mixed_precision)}
    measured = summary(zero_runs[stage])["state_bytes_per_rank"]
    assert rows[launch.strategy].state == pytest.approx(max(measured), rel=0.01)


def test_lora_under_zero_2_and_3_trains_resumes_and_exports_as_under_fsdp(tmp_path, env, small_corpus):
    """LoRA adapters (no dropout) under ZeRO-2 and ZeRO-3: the losses and the
    merged final model of the FSDP run, an exact resume, and the export."""
    args = ["train", *common_args(small_corpus), *TWO_RANKS, "--peft", "lora", "--lora_dropout", "0"]
    runs = {name: tmp_path / name for name in ("fsdp", "zero2", "zero3")}
    check_ok(run_cli([*args, "--output_dir", str(runs["fsdp"])], env, mixed_precision="no", warm=True))
    for stage in (2, 3):
        check_ok(run_cli([*args, "--output_dir", str(runs[f"zero{stage}"])], env, config=f"zero{stage}.yaml", warm=True))
        assert summary(runs[f"zero{stage}"])["distributed_type"] == "DEEPSPEED"
    reference = [r["loss"] for r in train_rows(runs["fsdp"])]
    assert len(reference) == STEPS
    merged = tensors(runs["fsdp"] / "final")
    for stage in (2, 3):
        run_dir = runs[f"zero{stage}"]
        assert [r["loss"] for r in train_rows(run_dir)] == pytest.approx(reference, abs=1e-5), stage
        final = tensors(run_dir / "final")
        assert final.keys() == merged.keys() and not any("lora" in name for name in final)
        assert max((final[n] - merged[n]).abs().max().item() for n in final) < 1e-5, stage

    resumed = interrupted_copy(runs["zero3"], CHECKPOINT_AT, tmp_path / "resumed", metrics=True)
    check_ok(run_cli(["resume", str(resumed)], env, config="zero3.yaml", warm=True))
    after = {r["step"]: r["loss"] for r in train_rows(resumed)}
    assert [after[s] for s in range(1, STEPS + 1)] == pytest.approx(reference, abs=1e-5)
    resumed_final = tensors(resumed / "final")
    assert max((resumed_final[n] - merged[n]).abs().max().item() for n in merged) < 1e-5

    out = tmp_path / "exported"
    proc = run_in_process("export", runs["zero3"], "--output", out)
    assert proc.returncode == 0, proc.stderr
    exported = tensors(out)
    assert exported.keys() == merged.keys()
    assert max((exported[n] - tensors(runs["zero3"] / "final")[n]).abs().max().item() for n in merged) < 1e-6
