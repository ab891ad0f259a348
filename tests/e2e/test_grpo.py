"""Online RL (--method grpo) on a tiny chat model: it learns under 2-process
FSDP (and its exported model scores higher, sampled with transformers alone),
takes the same steps under DDP, ZeRO-2 and with LoRA, resumes exactly after
SIGTERM, imports a reward file only when the command line names it, and
refuses bad reward functions and data in one line."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import REPO, check_ok, free_port, launches, read_jsonl, run_cli, run_cli_together, run_in_process, train_rows
from sft_models import save_chat_model, write_jsonl

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
REWARDS = '''
def a_rich(prompts, completions, completion_ids, answer, **columns):
    """The share of the letter a in the completion: dense, so a tiny model
    learns it in a few steps. Every row's answer column arrives."""
    assert len(answer) == len(completions) == len(prompts) == len(completion_ids)
    return [c[0]["content"].count("a") / max(len(c[0]["content"]), 1) for c in completions]


def unscored(prompts, completions, completion_ids, **columns):
    return [None] * len(completions)
'''
STEPS = 6


def a_share(text: str) -> float:
    return text.count("a") / max(len(text), 1)


@pytest.fixture(scope="module")
def grpo(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("grpo")
    rng = random.Random(0)
    rows = []
    for _ in range(96):
        said = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
        rows.append({"prompt": [{"role": "user", "content": f"say {said}"}], "answer": said})
    (root / "rewards.py").write_text(REWARDS)
    return {"model": save_chat_model(root / "model"), "prompts": write_jsonl(root / "prompts.jsonl", rows),
            "held_out": rows[-16:], "rewards": root / "rewards.py", "root": root}


def grpo_args(grpo: dict, *extra) -> list:
    return ["train", "--model", grpo["model"], "--dataset", grpo["prompts"], "--method", "grpo",
            "--reward_funcs", f"{grpo['rewards']}:a_rich", "--num_generations", "4", "--per_device_batch_size", "8",
            "--max_completion_length", "8", "--block_size", "64", "--learning_rate", "2e-2", "--lr_scheduler_type", "constant",
            "--max_eval_samples", "16",
            "--log_format", "plain", "--log_completions_every", "1", *extra]


@pytest.fixture(scope="module")
@launches
def fp32_run(grpo, env) -> Path:
    """2-process FSDP in fp32, two steps on each rollout (clipping acts), a
    checkpoint in the middle of a rollout: what the other backends, LoRA and
    the resumes are held to."""
    run = grpo["root"] / "fp32"
    check_ok(run_cli([*grpo_args(grpo, "--max_steps", str(STEPS), "--num_iterations", "2", "--checkpoint_every", "3"),
                      "--output_dir", run], env, mixed_precision="no", warm=True))
    return run


@pytest.mark.slow
def test_grpo_learns_under_fsdp_and_its_export_scores_higher(grpo, tmp_path, env):
    """fsdp.yaml as shipped (its precision), 2 processes: the reward rises in
    training and on held-out prompts, every metric has TRL's name, the weights
    are sharded, and the exported final/ beats the base model greedily."""
    run = tmp_path / "run"
    proc = run_cli([*grpo_args(grpo, "--max_steps", "24"), "--output_dir", run], env, warm=True)
    check_ok(proc)
    rows = train_rows(run)
    for name in ("reward", "reward_std", "rewards/a_rich/mean", "rewards/a_rich/std", "frac_reward_zero_std",
                 "completions/mean_length", "completions/clipped_ratio", "entropy", "clip_ratio/low_mean",
                 "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert all(name in row for row in rows), name
    assert "kl" not in rows[0]  # no KL term by default (beta 0, TRL's)
    assert "  reward " in proc.stdout and "rewards/a_rich/mean" in proc.stdout  # on the console line too
    # The closing sample answers a held-out prompt of the run's own, through the chat template.
    assert re.search(r"fine-tuned model's answer to the held-out prompt 'say [a-z ]+': '", proc.stdout), proc.stdout[-1500:]
    first, last = (sum(r["reward"] for r in part) / 4 for part in (rows[:4], rows[-4:]))
    assert last > first + 0.2, [round(r["reward"], 3) for r in rows]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["last_eval"]["reward"] > summary["first_eval"]["reward"] + 0.3, (summary["first_eval"],
                                                                                      summary["last_eval"])
    assert summary["method"] == "grpo" and summary["distributed_type"] == "FSDP"
    assert all(n < 0.6 * summary["total_params"] for n in summary["local_params_per_rank"])  # sharded
    assert "reward" in summary["last_rollout"]
    samples = read_jsonl(run / "completions.jsonl")
    assert {"prompt", "completion", "rewards/a_rich", "advantage"} <= set(samples[0])

    def held_out_reward(model_dir) -> float:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        scores = []
        for row in grpo["held_out"]:
            ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            scores.append(a_share(tokenizer.decode(out[0, ids.size(1):], skip_special_tokens=True)))
        return sum(scores) / len(scores)

    assert held_out_reward(run / "final") > held_out_reward(grpo["model"]) + 0.3
    # Its held-out prompts have no text to score perplexity on: said in one line, not scored on other text.
    refused = run_in_process("evaluate", run / "final")
    assert refused.returncode == 2 and "was trained with --method grpo" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.slow
def test_ddp_zero2_and_lora_take_the_same_steps(grpo, fp32_run, tmp_path, env):
    """DDP and ZeRO-2 log the FSDP run's rewards and losses; LoRA with a KL term
    (the base, adapters off, for reference) logs the same steps under FSDP and DDP."""
    steps = ["--max_steps", "4", "--num_iterations", "2"]
    lora = [*steps, "--peft", "lora", "--beta", "0.04"]
    cases = [("ddp", steps, "ddp.yaml"), ("zero2", steps, "zero2.yaml"), ("lora-fsdp", lora, "fsdp.yaml")]
    procs = run_cli_together([(grpo_args(grpo, *args, "--output_dir", tmp_path / name),
                               dict(config=config, mixed_precision="no")) for name, args, config in cases], env)
    procs.append(run_cli(grpo_args(grpo, *lora, "--output_dir", tmp_path / "lora-ddp"), env, config="ddp.yaml",
                         mixed_precision="no", warm=True))
    for proc in procs:
        check_ok(proc)
    expected = {r["step"]: r for r in train_rows(fp32_run)}
    for name in ("ddp", "zero2"):
        got = {r["step"]: r for r in train_rows(tmp_path / name)}
        assert sorted(got) == [1, 2, 3, 4]
        for step, row in got.items():
            for metric in ("loss", "reward", "entropy", "clip_ratio/region_mean"):
                assert row[metric] == pytest.approx(expected[step][metric], rel=1e-4, abs=1e-4), (name, step, metric)
    fsdp, ddp = ({r["step"]: r for r in train_rows(tmp_path / name)} for name in ("lora-fsdp", "lora-ddp"))
    assert sorted(fsdp) == sorted(ddp) == [1, 2, 3, 4]
    for step in fsdp:
        for metric in ("loss", "reward", "kl"):
            assert ddp[step][metric] == pytest.approx(fsdp[step][metric], rel=1e-4, abs=1e-4), (step, metric)
    assert fsdp[4]["kl"] > 0  # the adapters moved the policy from the base
    summary = json.loads((tmp_path / "lora-fsdp" / "summary.json").read_text())
    assert summary["reference"] == "the base, adapters off" and summary["reference_params_per_rank"] is None


@pytest.mark.slow
def test_the_replica_samples_what_the_sharded_model_does(grpo, fp32_run, tmp_path, env):
    """The fp32 run sampled from a replica (auto's pick for a sharded model
    that fits); sampling from the FSDP2-sharded model gives the same
    completions and losses step by step and the same final weights, and so do
    a replica and the partitioned model under ZeRO-3."""
    args = ["--max_steps", str(STEPS), "--num_iterations", "2"]
    cases = {"fsdp-sharded": ("fsdp.yaml", "sharded"), "zero3-sharded": ("zero3.yaml", "sharded"),
             "zero3-replica": ("zero3.yaml", "replica")}
    procs = run_cli_together([(grpo_args(grpo, *args, "--generation_engine", engine, "--output_dir", tmp_path / name),
                               dict(config=config, mixed_precision="no")) for name, (config, engine) in cases.items()],
                             env)
    for proc, (config, engine) in zip(procs, cases.values()):
        check_ok(proc)
        assert f"generation: {engine} (as asked" in proc.stdout, proc.stdout[-2000:]
    summary = json.loads((fp32_run / "summary.json").read_text())
    assert summary["generation_engine"] == "replica" and summary["distributed_type"] == "FSDP"
    rows = train_rows(fp32_run)  # the first rollout's replica was made for the first evaluation, before it
    assert all(row["rollout_time"] > 0 for row in rows) and all(row["weight_sync_time"] > 0 for row in rows[2:])

    def same_run(run: Path, like: Path) -> None:
        assert [(r["rollout"], r["completion"]) for r in read_jsonl(run / "completions.jsonl")] == \
            [(r["rollout"], r["completion"]) for r in read_jsonl(like / "completions.jsonl")], run.name
        expected = {r["step"]: r for r in train_rows(like)}
        for row in train_rows(run):
            for metric in ("loss", "reward", "entropy", "clip_ratio/region_mean"):
                assert row[metric] == pytest.approx(expected[row["step"]][metric], abs=1e-6), (run.name, row["step"])
        final, other = (load_file(str(r / "final" / "model.safetensors")) for r in (run, like))
        assert max(float((final[k] - other[k]).abs().max()) for k in other) <= 1e-6, run.name

    same_run(tmp_path / "fsdp-sharded", fp32_run)
    same_run(tmp_path / "zero3-replica", tmp_path / "zero3-sharded")


def test_vllm_engine_samples_from_the_trained_weights_and_sleeps_while_training(grpo, tmp_path, env):
    """--generation_engine vllm against the stand-in with vLLM's interface
    (tests/stand_ins/vllm: vLLM's CPU build does not install here), under
    2-process FSDP2: full weights with sleep mode, and LoRA (merged into the
    weights it loads) without. The engine's log-probs of what it sampled equal
    the trainer's at every step, so it sampled from the trained weights each
    time; it was woken to sample and put back to sleep; each load sent every weight."""
    stand_in = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests" / "stand_ins"),
                                                                     env.get("PYTHONPATH")]))}
    log = tmp_path / "engine.jsonl"
    stand_in["VLLM_STAND_IN_LOG"] = str(log)
    cases = {"full": ["--generation_engine", "vllm", "--vllm_enable_sleep_mode"],
             "lora": ["--use_vllm", "--peft", "lora", "--learning_rate", "5e-2"]}
    procs = run_cli_together([(grpo_args(grpo, "--max_steps", "3", *extra, "--output_dir", tmp_path / name),
                               dict(mixed_precision="no")) for name, extra in cases.items()], stand_in)
    model = AutoModelForCausalLM.from_pretrained(grpo["model"])
    weights = len(dict(model.named_parameters(remove_duplicate=False)))
    runs = {}  # each run's events, by the process that made them
    for event in read_jsonl(log):
        if event["event"] == "start":
            runs[event["pid"]] = Path(event["argv"][event["argv"].index("--output_dir") + 1]).name
    for proc, name in zip(procs, cases):
        check_ok(proc)
        assert "generation: vllm (as asked)" in proc.stdout, proc.stdout[-2000:]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["generation_engine"] == "vllm" and summary["distributed_type"] == "FSDP"
        assert all(n < 0.6 * summary["total_params"] for n in summary["local_params_per_rank"])  # sharded
        rows = train_rows(tmp_path / name)
        assert [r["step"] for r in rows] == [1, 2, 3]
        for row in rows:
            assert row["sampling/sampling_logp_difference/max"] < 1e-4, (name, row)
            assert row["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3), (name, row)
            assert row["rollout_time"] > 0 and row["train_time"] > 0, (name, row)
        # Awake throughout, LoRA's first rollout samples the weights loaded for the first evaluation.
        assert all(row["weight_sync_time"] > 0 for row in rows[name == "lora":]), name
        events = [e for e in read_jsonl(log) if runs.get(e["pid"]) == name]
        for rank in (0, 1):
            mine = [e for e in events if e["rank"] == rank]
            start = mine[0]
            assert start["event"] == "start" and start["distributed_executor_backend"] == "external_launcher"
            assert start["gpu_memory_utilization"] == 0.3 and start["enable_sleep_mode"] == (name == "full")
            generated = [e for e in mine if e["event"] == "generate"]
            assert generated and all(e["finite"] for e in generated), name
            loads = [e["loaded"] for e in mine if e["event"] == "reset_prefix_cache"]
            assert loads and all(n == weights for n in loads), (name, loads, weights)
            if name == "full":  # woken for each sampling, the weights loaded again, asleep while training
                kinds = [e["event"] for e in mine[1:]]
                assert kinds[0] == "sleep" and kinds.count("generate") == kinds.count("sleep") - 1, kinds
                assert len(loads) == len(generated)
            else:  # awake throughout; loaded again only after an optimizer step
                assert "sleep" not in [e["event"] for e in mine] and len(loads) <= 1 + 3, loads


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_or_sigkill_resumes_with_the_same_completions_and_losses(grpo, fp32_run, tmp_path,
                                                                                          env):
    """A run stopped by SIGTERM and one killed by SIGKILL (both sampling from
    a replica, auto's pick), resumed from a plain shell (naming the reward file
    again), and a resume from the checkpoint written in the middle of a
    rollout, log the uninterrupted run's samples, rewards and losses."""
    args = [*grpo_args(grpo, "--max_steps", str(STEPS), "--num_iterations", "2", "--checkpoint_every", "3")]
    stopped, killed = tmp_path / "stopped", tmp_path / "killed"

    def start(run: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
             str(REPO / "accelerate_configs/fsdp.yaml"), "--num_processes", "2", "--mixed_precision", "no",
             "--main_process_port", str(free_port()), "-m", "finetune", *map(str, args), "--output_dir", str(run)],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    launchers = {stopped: start(stopped), killed: start(killed)}
    deadline, waiting = time.time() + 240, dict(launchers)
    while waiting:  # each stopped as soon as its step-3 checkpoint (written mid-rollout) is in place
        for run, launcher in list(waiting.items()):
            assert launcher.poll() is None and time.time() < deadline, launcher.communicate()[1][-3000:]
            if (run / "checkpoints" / "step_000003").is_dir():
                os.killpg(launcher.pid, signal.SIGTERM if run == stopped else signal.SIGKILL)
                del waiting[run]
        time.sleep(0.05)
    _, err = launchers[stopped].communicate(timeout=120)
    launchers[killed].communicate(timeout=120)
    assert launchers[killed].returncode != 0 and not (killed / "final").exists()
    stop = re.search(r"stopped: SIGTERM at step (\d+)", err)
    assert stop, err[-3000:]

    refused = run_in_process("resume", stopped)  # the reward file is named only in run_config.yaml
    assert refused.returncode == 2
    line = refused.stderr.strip().splitlines()
    assert len(line) == 1 and "--reward_funcs" in line[0] and "your own code" in line[0], refused.stderr
    for run in (stopped, killed):
        check_ok(run_cli(["resume", run, "--reward_funcs", f"{grpo['rewards']}:a_rich"], env, nproc=None, timeout=300))

    middle = tmp_path / "from-step-3"  # step 3 trained on the first step of a rollout; step 4 trains on it again
    check_ok(run_cli([*args, "--output_dir", middle, "--resume_from_checkpoint",
                      fp32_run / "checkpoints" / "step_000003"], env, mixed_precision="no", warm=True))
    expected = {r["step"]: r for r in train_rows(fp32_run)}
    for run, first in ((stopped, 1), (killed, 1), (middle, 4)):
        got = {r["step"]: r for r in train_rows(run)}
        assert sorted(got) == list(range(first, STEPS + 1)), run
        for step, row in got.items():
            for metric in ("loss", "reward", "entropy", "completions/mean_length"):
                assert row[metric] == pytest.approx(expected[step][metric], abs=1e-6), (run.name, step, metric)
    whole = [(r["rollout"], r["completion"]) for r in read_jsonl(fp32_run / "completions.jsonl")]
    # The stopped and killed runs' samples after their checkpoints were dropped and sampled again, the same.
    for run in (stopped, killed):
        assert [(r["rollout"], r["completion"]) for r in read_jsonl(run / "completions.jsonl")] == whole, run.name
    assert json.loads((killed / "summary.json").read_text())["generation_engine"] == "replica"
    assert [(r["rollout"], r["completion"]) for r in read_jsonl(middle / "completions.jsonl")] == \
        [s for s in whole if s[0] >= 2]  # rollout 1 came from the checkpoint; 2 was sampled again, the same


def test_a_killed_first_rollout_is_not_in_the_way_and_no_reward_at_all_is_said(grpo, tmp_path):
    """What a run killed before its first checkpoint left (its run_config.yaml,
    metrics, completions) is started afresh by the same command; a reward
    that applies to no completion trains, saying so."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("run_config.yaml", "metrics.jsonl", "completions.jsonl"):
        (run / name).write_text('{"step": 1, "stale": true}\n')
    proc = run_in_process(*grpo_args(grpo, "--max_steps", "1", "--per_device_batch_size", "4",
                                     "--checkpoint_every", "0"),
                          "--reward_funcs", f"{grpo['rewards']}:unscored", "--output_dir", run)
    check_ok(proc)
    assert "holds a run that failed before its first checkpoint: starting it afresh" in proc.stdout
    assert re.search(r"warning: every reward function \(unscored\) returned None for every completion of rollout 0",
                     proc.stdout), proc.stdout[-2000:]
    assert "stale" not in (run / "completions.jsonl").read_text() + (run / "metrics.jsonl").read_text()


def test_a_batch_of_part_groups_ends_in_one_line(grpo, tmp_path):
    """(Bad reward functions and data, found in the first rollout, are in test_errors.py's table.)"""
    cases = [(["--per_device_batch_size", "6"], "is not a multiple of --num_generations 4")]
    for extra, says in cases:
        proc = run_in_process(*grpo_args(grpo, "--max_steps", "1"), *extra, "--output_dir", tmp_path / "run")
        assert proc.returncode == 2, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and says in errors[0], proc.stderr[-2000:]
        assert not (tmp_path / "run").exists()


def test_evaluate_of_a_grpo_model_scores_text_and_names_what_prompts_lack(grpo, fp32_run, tmp_path):
    """The run's own held-out data is prompts: evaluate says so, scores text
    given with --dataset, and refuses prompt data in its own words (it has no --method)."""
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": f"say {' '.join(WORDS)} {i}"} for i in range(8)])
    scored = run_in_process("evaluate", fp32_run / "final", "--dataset", texts)
    check_ok(scored)
    assert json.loads(scored.stdout.strip().splitlines()[-1])["perplexity"] > 1
    for extra, says in (([], "whose held-out data (prompts alone (a prompt column)) has no text"),
                        (["--dataset", grpo["prompts"]], "finetune evaluate scores perplexity on text, and --dataset")):
        proc = run_in_process("evaluate", fp32_run / "final", *extra)
        assert proc.returncode == 2 and says in proc.stderr and "--method" not in proc.stderr.split(says)[1], \
            proc.stderr[-2000:]
