"""Benchmarks: every case runs in this one invocation, on the same model and data,
so the figures compare like with like. Results go to outputs/bench/ as a
markdown table and JSON.

    python scripts/bench.py --suite configs [--model gpt2-small] [--steps 6] [--mixed_precision no] [--profile]
    python scripts/bench.py --suite baselines [--model gpt2-small]
    python scripts/bench.py --suite packing [--model small-gpt2] [--block_size 256]
    python scripts/bench.py --suite loss --batch 4 --block_size 512 [--model gpt2-small] [--baseline_ref REF]
    python scripts/bench.py --suite startup [--rounds 3] [--baseline_ref REF]
    python scripts/bench.py --suite lora [--model gpt2-small] [--lora_r 16]   # QLoRA too on a GPU
    python scripts/bench.py --suite dpo [--model gpt2-small]   # against TRL's DPOTrainer: pip install trl
    python scripts/bench.py --suite kto|reward [--model gpt2-small]   # against TRL's KTOTrainer, RewardTrainer
    python scripts/bench.py --suite data [--model tiny-gpt2] [--data_workers 2]   # the stream against training
    python scripts/bench.py --suite grpo [--model small-gpt2]   # against TRL's GRPOTrainer: pip install trl
    python scripts/bench.py --suite moe      # a tiny Qwen3-MoE, against TRL's SFTTrainer: pip install trl
    python scripts/bench.py --suite vlm      # a LLaVA on drawn images, against TRL's SFTTrainer: pip install trl
    python scripts/bench.py --quick          # both suites on tiny-gpt2, few steps (about 2 minutes here)

The default model is the GPT-2 124M-shaped preset `gpt2-small` (with `--batch
4`, about 10 minutes for both suites on 2 CPU cores); `--quick` uses `tiny-gpt2`.

Suite `configs`: each CPU-capable accelerate config (zero1/2/3.yaml too when
the deepspeed extra is installed; hsdp.yaml and tp.yaml on 4 processes, tp.yaml
for a model transformers has a tensor-parallel plan for, such as a Llama dir)
trains the same model on the same blocks, with the same global batch; reported per config: median step time (after 2 warm-up steps), its
ratio to DDP, per-rank peak memory (resident set on CPU, max_memory_allocated on
GPU) and per-rank persistent state (parameters + gradients + optimizer state,
measured after the first optimizer step), all in bytes.

Suite `baselines`: one process, same model, same blocks, same batch and
precision: our loop (`python -m finetune train`) against the Hugging Face
`Trainer`, the tool most users would otherwise reach for, and our loop in bf16
against fp32. On CPUs also our loop as 2 FSDP processes on the same cores (one
thread each, the same global batch). Reported: median step time and tokens/s,
and their ratios. `--model` may be a pretrained model (a HF dir, or a GGUF
file such as the quickstart's SmolLM2: `--model $(bash scripts/fetch_smollm2.sh)`),
which every case fine-tunes from its weights.

Both suites report model FLOPs utilisation: training FLOPs per token (6 x
parameters + 12 x layers x width x block, as nanoGPT counts them) times
tokens/s, over the device's matmul peak measured in this same invocation (the
faster of fp32 and bf16, per thread, times the cores the case uses; accelerate
launch gives each process one thread).

Each suite ends with its targets, met or missed and by how much: FSDP full shard
at most 1.15 x DDP's step time, FSDP state per rank within 1.1 x 16P/N bytes (fp32 AdamW:
parameters, gradients and two moments, 4 bytes each), our loop at least 1.15x
the Trainer's tokens/s on tiny-gpt2 and 1.0x on larger models.

`--profile` also records steps with torch.profiler (`finetune train
--profile_steps`) and tables where each case's step time goes on rank 0: data
loading, forward/backward compute, FSDP all-gather and reduce-scatter, other
collectives, the optimizer step, and the rest (Python, hooks, autograd).

`--compile` adds our loop under torch.compile (Accelerate's inductor backend)
to the baselines; compilation happens in the warm-up steps, which are not timed.
On a GPU machine the same commands run on the GPUs: the matmul
peak is measured on one GPU (8192 x 8192), MFU is per GPU, the configs suite
keeps the configs it has enough GPUs for, and the Trainer runs on the GPU.

Suite `data`: the stream's data pipeline against training's consumption.
2-process FSDP trains on the built-in corpus five times over, in 4 .jsonl.gz
shards, with `--streaming` and without; then one streamed rank's pipeline
(reading its shards, tokenizing, cutting blocks) runs alone: in the process,
with `--data_workers` encoding workers, and on 3 shards (which 2 ranks do not
divide). Reported: tokens/s per rank and the pipeline's multiple of what
streamed training consumes (the target: at least 1x), each run's peak resident
set per rank, and the memory the pipeline holds (unique set size, its process's
rise and each worker's).

Suite `packing`: instruction tuning on the built-in questions (`--data_format
chat`, a plain role-prefixed chat template written for the preset's tokenizer),
2-process FSDP, the same model, examples and batch: packed blocks against one
example per row padded to the batch's longest. Reported: real tokens/s (padding
never counts) over the timed steps, and its ratio.

Suite `loss`: one process, the same model, blocks and batch (`--batch` sequences
per step), the cross-entropy over the full logits (`--loss_chunk_size 0`)
against the chunked one (the default): the peak bytes torch's allocator held
during a profiled step above what lived between steps, the median step time,
and how far the chunked run's losses are from the full one's. With
`--baseline_ref REF`, REF's code runs first as it was (today's step, before
the chunked loss and the one-kernel GELU) and the ratios are against it.

Suite `startup`: on tiny-gpt2 with warm caches, the seconds from `accelerate
launch` (fsdp.yaml, 2 processes) to the first training step's metrics row
(the first evaluation, one batch, included), and the whole of `finetune
generate` (8 new tokens) and `finetune export` of that run. With
`--baseline_ref REF` the same commands also run on a git worktree of REF (a
commit, tag or branch), interleaved with this checkout's: before and after in
one invocation.

`--rounds R` runs every case R times, interleaved, and keeps each case's fastest
round, so a burst of load from elsewhere on the machine does not decide a ratio.

`--only NAME[,NAME...]` runs the cases whose config or name contains a NAME (the test suite
runs `--quick --suite configs --only single` so this script cannot rot).
"""

from __future__ import annotations

import argparse
import functools
import contextlib
import gc
import gzip
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CPU_CONFIGS = {  # config -> processes
    "single.yaml": 1,
    "ddp.yaml": 2,
    "fsdp.yaml": 2,
    "fsdp_shard_grad_op.yaml": 2,
    "fsdp_activation_checkpointing.yaml": 2,
    "hsdp.yaml": 4,  # 2 replicas x 2 shards
    "tp.yaml": 4,    # 2 shards x tensor parallel 2: a model transformers has a tensor-parallel plan for
}
TENSOR_PARALLEL = {"tp.yaml": 2}  # ranks that read the same batch
if importlib.util.find_spec("deepspeed") is not None:  # the deepspeed extra: ZeRO next to FSDP, as the seed compares them
    CPU_CONFIGS.update({"zero1.yaml": 2, "zero2.yaml": 2, "zero3.yaml": 2})


def checkout_env(checkout: Path) -> dict:
    """The environment that runs `-m finetune` from `checkout` (this repo or a baseline worktree)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(checkout)}


@contextlib.contextmanager
def checkouts(baseline_ref: str, tmp: str):
    """{label: checkout dir}: a git worktree of `baseline_ref` first when given, then this checkout."""
    if not baseline_ref:
        yield {"this checkout": REPO}
        return
    baseline = Path(tmp) / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", str(baseline), baseline_ref], cwd=REPO, check=True,
                   capture_output=True)
    try:
        yield {f"baseline {baseline_ref}": baseline, "this checkout": REPO}
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=REPO, capture_output=True)


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def launch(config: str, nproc: int, train_args: list[str], mixed_precision: str, threads: int | None = None,
           compiled: bool = False, checkout: Path = REPO) -> None:
    """`accelerate launch` gives each process 1 thread unless told otherwise;
    `compiled` runs the model through torch.compile (Accelerate's dynamo backend)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(checkout / "accelerate_configs" / config),
           "--num_processes", str(nproc), "--mixed_precision", mixed_precision]
    if threads:
        cmd += ["--num_cpu_threads_per_process", str(threads)]
    if compiled:
        cmd += ["--dynamo_backend", "inductor"]
    cmd += ["-m", "finetune", "train", *train_args]
    proc = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, env=checkout_env(checkout))
    if proc.returncode != 0:
        sys.exit(f"{config} failed:\n{proc.stderr[-3000:]}")


def matmul_size() -> int:
    return 8192 if on_gpu() else 512


def matmul_peak_flops(threads: int, dtype_name: str, seconds: float = 0.5) -> float:
    """FLOP/s of a square matmul on one GPU, or on the CPU with this many
    threads, timed over about `seconds` (slow dtypes get fewer repetitions)."""
    import torch

    n, device = matmul_size(), "cuda" if on_gpu() else "cpu"
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    a @ b  # warm-up
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or reps == 0:
        a @ b
        reps += 1
        if device == "cuda":
            torch.cuda.synchronize()
    torch.set_num_threads(previous)
    return 2 * n**3 * reps / elapsed


def model_source(model: str) -> str:
    """A HF model dir for --model: a preset's name as it is, a GGUF file's converted dir (cached by finetune)."""
    from finetune.models.gguf import converted_dir, is_gguf

    return str(converted_dir(model)) if is_gguf(model) else model


def layers_and_width(model: str) -> tuple[int, int]:
    from finetune.presets import GPT2_PRESETS

    if model in GPT2_PRESETS:
        return GPT2_PRESETS[model]["n_layer"], GPT2_PRESETS[model]["n_embd"]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_source(model), trust_remote_code=False)
    return config.num_hidden_layers, config.hidden_size


def train_flops_per_token(model: str, block_size: int, total_params: int) -> float:
    layers, width = layers_and_width(model)
    return 6 * total_params + 12 * layers * width * block_size


def mfu(result: dict, args, units: int, peaks: dict) -> float:
    """Model FLOPs utilisation against the device's peak: the faster of the fp32
    and bf16 matmul, per CPU thread or per GPU, times the cores or GPUs (`units`)
    the case uses. (On CPUs without native bf16 the bf16 matmul is far slower,
    so bf16 runs show what they waste.)"""
    for dtype in ("no", "bf16"):
        if dtype not in peaks:
            peaks[dtype] = matmul_peak_flops(1, dtype)
    flops = train_flops_per_token(args.model, args.block_size, result["total_params"]) * result["tokens_per_sec"]
    return flops / (max(peaks.values()) * units)


def peaks_line(peaks: dict) -> str:
    n = matmul_size()
    return f"matmul peak per {'GPU' if on_gpu() else 'core'}, measured in this run ({n} x {n}, FLOP/s): " + \
        ", ".join(f"{'fp32' if dtype == 'no' else dtype} {flops:,.0f}" for dtype, flops in peaks.items())


def measure(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "loss" in r][2:]  # after 2 warm-up steps
    step_time = statistics.median(r["step_time_s"] for r in timed)
    tokens_per_step = timed[0]["tokens_per_sec"] * timed[0]["step_time_s"]
    return {
        "distributed_type": summary["distributed_type"],
        "world_size": summary["world_size"],
        "step_time_s": step_time,
        "tokens_per_sec": tokens_per_step / step_time,
        "peak_memory_bytes_per_rank": summary["peak_memory_bytes_per_rank"],
        "state_bytes_per_rank": summary["state_bytes_per_rank"],
        "state_elements_per_rank": summary["state_elements_per_rank"],
        "local_params_per_rank": summary["local_params_per_rank"],
        "total_params": summary["total_params"],
        "parallelism": summary["parallelism"],
    }


def run_ours(config: str, nproc: int, args, run_dir: Path, batch: int, mixed_precision: str, profile: bool,
             threads: int | None = None, compiled: bool = False, checkout: Path = REPO) -> dict:
    """One timed run of our loop, and with `profile` a second, profiled run of
    the same case (the profiler slows the steps it records, so they are never
    the ones timed)."""
    launch(config, nproc, train_args(args, run_dir, batch), mixed_precision, threads, compiled, checkout)
    result = measure(run_dir)
    if profile:
        profiled_dir = run_dir.with_name(run_dir.name + "-profile")
        launch(config, nproc, train_args(args, profiled_dir, batch, profile=True), mixed_precision, threads, compiled,
               checkout)
        breakdown = json.loads((profiled_dir / "profile" / "rank0_breakdown.json").read_text())
        result["profile_ms_per_step"] = breakdown["ms_per_step"]
        result["profile_peak_step_allocation_bytes"] = breakdown["peak_step_allocation_bytes"]
    return result


def train_args(args, run_dir: Path, batch: int, profile: bool = False) -> list[str]:
    extra = ["--profile_steps", str(max(1, args.steps - 2))] if profile else []
    return ["--model", args.model, "--dataset", args.dataset, "--max_steps", str(args.steps),
            "--block_size", str(args.block_size), "--per_device_batch_size", str(batch),
            "--max_eval_batches", "1", "--sample_prompt", "", "--output_dir", str(run_dir), *extra]


def run_trl(case: str, script: str, script_args: list, run_dir: Path, args) -> tuple[dict, list[dict]]:
    """One of TRL's trainers (scripts/SCRIPT with SCRIPT_ARGS, then the
    precision) launched as ours are: fsdp.yaml, 2 processes. Its row of the
    table, and each rank's record (none when it failed)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "fsdp.yaml"), "--num_processes", "2", "--mixed_precision",
           args.mixed_precision, str(REPO / "scripts" / script), *map(str, script_args), args.mixed_precision]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=checkout_env(REPO))
    if proc.returncode != 0:
        error = next((line for line in reversed(proc.stderr.splitlines()) if "Error" in line), "failed")
        return {"case": case, "step_time_s": math.inf, "failed": error.strip()[:200]}, []
    ranks = [json.loads((run_dir / f"rank-{r}.json").read_text()) for r in range(2)]
    step = statistics.median(max(times) for times in zip(*(r["step_times"][1:] for r in ranks)))
    return {"case": case, "step_time_s": step, "peak_memory_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
            "distributed_type": ranks[0]["distributed_type"],
            "local_params_per_rank": [r["local_params"] for r in ranks]}, ranks


def fastest_rounds(cases: list, run_case, rounds: int) -> list[dict]:
    """Run every case `rounds` times, interleaved, and keep each one's fastest."""
    best: dict = {}
    for round_index in range(rounds):
        for case in cases:
            result = run_case(case, round_index)
            if case not in best or result["step_time_s"] < best[case]["step_time_s"]:
                best[case] = {**best.get(case, {}), **result}  # keeps round 0's profile
    return [best[case] for case in cases]


def target_line(name: str, value: float, target: float, higher_is_better: bool) -> str:
    met = value >= target if higher_is_better else value <= target
    verdict = "met" if met else f"MISSED by {abs(value / target - 1):.0%}"
    return f"- {name}: {value:.2f} (target {'>=' if higher_is_better else '<='} {target:.2f}): {verdict}"


def profile_table(results: list[dict], label: str) -> list[str]:
    profiled = [r for r in results if "profile_ms_per_step" in r]
    if not profiled:
        return []
    phases = list(profiled[0]["profile_ms_per_step"])
    lines = ["", "where the step time goes on rank 0 (ms per step in a separate profiled run; the profiler "
             "slows the steps it records, most of all in `other`), and the peak bytes torch's allocator held "
             "for a step above what lived between steps", "",
             f"| {label} | " + " | ".join(phases) + " | torch peak step allocation (bytes) |",
             "| --- |" + " --- |" * (len(phases) + 1)]
    for r in profiled:
        ms = r["profile_ms_per_step"]
        lines.append(f"| {r[label]} | " + " | ".join(f"{ms[p]:.1f}" for p in phases) +
                     f" | {r['profile_peak_step_allocation_bytes']} |")
    return lines


def split_over(result: dict) -> int:
    """The ranks one copy of the model is split over: all of them, but one replica's under HSDP."""
    mesh = result["parallelism"]
    return mesh["dp_shard"] * mesh["tp"] if result["distributed_type"] == "FSDP" else result["world_size"]


def suite_configs(args) -> tuple[list[dict], str]:
    import torch

    peaks: dict = {}
    # On a GPU machine, the configs it has enough GPUs for (one process per GPU).
    configs = [c for c, nproc in CPU_CONFIGS.items() if (not args.only or any(name in c for name in args.only.split(",")))
               and (not on_gpu() or nproc <= torch.cuda.device_count())]
    if "tp.yaml" in configs:
        from finetune.memory import model_shape

        if not model_shape(args.model).tp_plan:
            print(f"[bench] tp.yaml left out: transformers has no tensor-parallel plan for {args.model}", flush=True)
            configs.remove("tp.yaml")
    with tempfile.TemporaryDirectory() as tmp, checkouts(args.baseline_ref, tmp) as dirs:
        def run_case(case: tuple[str, str], round_index: int) -> dict:
            label, config = case
            nproc = CPU_CONFIGS[config]
            # The same global batch everywhere: 1 process takes both ranks' share, 4 data-parallel
            # ranks half of it each, a tensor-parallel group reads one share.
            data_parallel = nproc // TENSOR_PARALLEL.get(config, 1)
            run_dir = Path(tmp) / f"{list(dirs).index(label)}-{config}-{round_index}"
            name = config if len(dirs) == 1 else f"{config} ({label})"
            print(f"[bench] {name} on {nproc} process(es)", flush=True)
            result = {"config": name, **run_ours(config, nproc, args, run_dir, args.batch * 2 // data_parallel,
                                                 args.mixed_precision, profile=args.profile and round_index == 0,
                                                 checkout=dirs[label])}
            result["mfu"] = mfu(result, args, units=nproc, peaks=peaks)
            return result

        cases = [(label, config) for label in dirs for config in configs]
        results = fastest_rounds(cases, run_case, args.rounds)
    # Each checkout's ratios against its own DDP (else against its first case).
    reference = {label: next((r for r in mine if r["config"].startswith("ddp.yaml")), mine[0])
                 for label, mine in ((label, [r for r, (l, _) in zip(results, cases) if l == label]) for label in dirs)}
    reference_of = {id(r): reference[label] for r, (label, _) in zip(results, cases)}
    ddp = reference[next(iter(dirs))]
    ideal_state = 16 * results[0]["total_params"]  # fp32 AdamW: param, grad, 2 moments
    lines = [f"model {args.model}, {args.steps} steps, global batch {args.batch * 2} x {args.block_size} tokens, "
             f"mixed_precision {args.mixed_precision}, fastest of {args.rounds} round(s)", "",
             f"ratios against {ddp['config'].split(' (')[0]}{' of the same checkout' if len(dirs) > 1 else ''}; MFU against the measured matmul peak of the cores each case uses; "
             "state vs ideal = largest per-rank state over 16P over the ranks one copy is split over "
             "(N; shards x tensor parallel under HSDP and TP)", "",
             "| config | type | ranks | step time (s) | vs DDP | tokens/s | MFU | peak memory per rank (bytes) | "
             "state per rank (bytes) | state vs DDP | state vs ideal | rank 0 params / grads / optimizer (elements) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        ddp = reference_of[id(r)]
        lines.append(f"| {r['config']} | {r['distributed_type']} | {r['world_size']} | {r['step_time_s']:.3f} | "
                     f"{r['step_time_s'] / ddp['step_time_s']:.2f} | {r['tokens_per_sec']:,.0f} | {r['mfu']:.1%} | "
                     f"{', '.join(map(str, r['peak_memory_bytes_per_rank']))} | "
                     f"{', '.join(map(str, r['state_bytes_per_rank']))} | "
                     f"{max(r['state_bytes_per_rank']) / max(ddp['state_bytes_per_rank']):.2f} | "
                     f"{max(r['state_bytes_per_rank']) / (ideal_state / split_over(r)):.2f} | "
                     f"{' / '.join(f'{v[0]:,}' for v in r['state_elements_per_rank'].values())} |")
    lines += ["", peaks_line(peaks)]
    lines += profile_table(results, "config")
    by_config = {r["config"]: r for r in results}
    targets = []
    for label in dirs:
        suffix = "" if len(dirs) == 1 else f" ({label})"
        if f"fsdp.yaml{suffix}" in by_config and f"ddp.yaml{suffix}" in by_config:
            targets.append(target_line(f"FSDP full shard / DDP step time at 2 processes{suffix}",
                                       by_config[f"fsdp.yaml{suffix}"]["step_time_s"] /
                                       by_config[f"ddp.yaml{suffix}"]["step_time_s"], 1.15, False))
    for r in results:
        if r["distributed_type"] == "FSDP":
            targets.append(target_line(f"{r['config']} state per rank / (16P/{split_over(r)})",
                                       max(r["state_bytes_per_rank"]) / (ideal_state / split_over(r)), 1.1, False))
    if targets:
        lines += ["", "targets:", *targets]
    return results, "\n".join(lines)


def step_timer():
    """A Trainer callback whose `times` are the seconds between step ends, data
    loading included: what our loop logs as step_time_s."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.last = [], None

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now

    return StepTimer()


def write_rank_result(trainer, timer, out: Path, **extra) -> None:
    """A TRL script's rank result, OUT/rank-N.json: its step times, peak
    resident set, and what the Trainer made of the launch (the distributed
    type and how many parameters this rank holds), with `extra` fields."""
    import resource

    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in trainer.model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{trainer.accelerator.process_index}.json").write_text(json.dumps({
        "step_times": timer.times, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "distributed_type": trainer.accelerator.distributed_type.value, "local_params": local, **extra}))


def trainer_step_times(run_dir: Path, args, mixed_precision: str) -> list[float]:
    """The HF Trainer on the blocks our run trained on (same tokenizer, data,
    split, seed), the same model (a preset built from the seed, or --model's
    pretrained weights), batch, LR and steps; step times from a callback, so
    start-up and data preparation are not counted."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from finetune import models
    from finetune.data.text import load_raw_text, tokenize_and_group
    from finetune.presets import GPT2_PRESETS

    preset = args.model in GPT2_PRESETS
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "tokenizer" if preset else model_source(args.model),
                                              trust_remote_code=False)
    blocks = tokenize_and_group(load_raw_text(args.dataset, "text", 0.05, 42), tokenizer, args.block_size)["train"]
    torch.manual_seed(42)
    config = models.gpt2_config(GPT2_PRESETS[args.model], tokenizer.bos_token_id, tokenizer.eos_token_id) if preset else None
    model = (models.build_gpt2(config) if preset
             else AutoModelForCausalLM.from_pretrained(model_source(args.model), dtype=torch.float32,
                                                       trust_remote_code=False))

    timer = step_timer()
    training_args = TrainingArguments(
        output_dir=str(run_dir / "trainer"), per_device_train_batch_size=args.batch * 2, max_steps=args.steps,
        learning_rate=1e-3, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0, lr_scheduler_type="cosine",
        warmup_steps=1, bf16=mixed_precision == "bf16", use_cpu=not on_gpu(), report_to=[], save_strategy="no",
        logging_steps=args.steps, disable_tqdm=True, dataloader_drop_last=True, seed=42)
    collate = lambda rows: {"input_ids": torch.stack([r["input_ids"] for r in rows]),  # noqa: E731
                            "labels": torch.stack([r["input_ids"] for r in rows])}
    trainer = Trainer(model=model, args=training_args, train_dataset=blocks, data_collator=collate, callbacks=[timer])
    trainer.train()
    # The Trainer runs in this process: give its GPU memory back before our loop's processes need it.
    del trainer, model
    gc.collect()
    if on_gpu():
        torch.cuda.empty_cache()
    return timer.times


def suite_baselines(args) -> tuple[list[dict], str]:
    """1 process, global batch = args.batch * 2, the same for every case."""
    from finetune.hardware import cpu_has_native_bf16

    peaks: dict = {}
    cores = os.cpu_count()
    units = 1 if on_gpu() else cores  # one GPU, or every CPU core
    cases = [("finetune loop", "no"), ("HF Trainer", "no")]
    notes = []
    if on_gpu() or cpu_has_native_bf16() or args.model == "tiny-gpt2":
        cases.append(("finetune loop", "bf16"))
        if args.trainer_bf16:
            cases.append(("HF Trainer", "bf16"))
    else:
        notes.append(f"bf16 not timed on {args.model}: this CPU has no native bf16 matmul (see the measured peaks); "
                     "`--quick` times it on tiny-gpt2")
    if args.compile:
        cases += [("finetune loop, compiled", mixed_precision) for name, mixed_precision in cases
                  if name == "finetune loop"]
    if not on_gpu():  # the same cores split between two FSDP processes, one thread each
        cases.append(("finetune loop, fsdp.yaml x 2", "no"))
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_run = Path(tmp) / "finetune loop-no-0"  # the first case: the Trainer reuses its tokenizer

        def run_case(case: tuple[str, str], round_index: int) -> dict:
            name, mixed_precision = case
            print(f"[bench] {name}, {mixed_precision}", flush=True)
            if name == "HF Trainer":
                step = statistics.median(trainer_step_times(tokenizer_run, args, mixed_precision)[1:])
                result = {"step_time_s": step, "tokens_per_sec": args.batch * 2 * args.block_size / step,
                          "total_params": json.loads((tokenizer_run / "summary.json").read_text())["total_params"]}
            else:
                run_dir = Path(tmp) / f"{name}-{mixed_precision}-{round_index}"
                # All cores, as the in-process Trainer has; FSDP's two processes get half each.
                nproc = 2 if name.endswith("x 2") else 1
                result = run_ours("fsdp.yaml" if nproc == 2 else "single.yaml", nproc, args, run_dir,
                                  args.batch * 2 // nproc, mixed_precision, profile=args.profile and round_index == 0,
                                  threads=cores // nproc, compiled=name.endswith("compiled"))
            result = {"case": f"{name} ({mixed_precision})", **result}
            result["mfu"] = mfu(result, args, units, peaks)
            return result

        results = fastest_rounds(cases, run_case, args.rounds)
    by_case = {r["case"]: r for r in results}
    ours, trainer = by_case["finetune loop (no)"], by_case["HF Trainer (no)"]
    lines = [f"model {args.model}, {args.steps} steps, global batch {args.batch * 2} x {args.block_size} tokens, "
             f"{cores} threads (1 process, or 2 FSDP processes with half each), fastest of {args.rounds} round(s)", "",
             "| case | step time (s) | tokens/s | tokens/s vs HF Trainer (fp32) | MFU |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['case']} | {r['step_time_s']:.3f} | {r['tokens_per_sec']:,.0f} | "
                     f"{r['tokens_per_sec'] / trainer['tokens_per_sec']:.2f} | {r['mfu']:.1%} |")
    lines += ["", peaks_line(peaks), *notes]
    if "finetune loop (bf16)" in by_case:
        lines.append(f"our loop bf16 / fp32: {by_case['finetune loop (bf16)']['tokens_per_sec'] / ours['tokens_per_sec']:.2f}x "
                     "tokens/s")
    lines += profile_table(results, "case")
    lines += ["", "targets:", target_line("our loop / HF Trainer tokens/s, fp32", ours["tokens_per_sec"] /
                                          trainer["tokens_per_sec"], 1.15 if args.model == "tiny-gpt2" else 1.0, True)]
    if fsdp := by_case.get("finetune loop, fsdp.yaml x 2 (no)"):
        lines.append(target_line("2-process FSDP / 1 process tokens/s, same cores", fsdp["tokens_per_sec"] /
                                 ours["tokens_per_sec"], 1.0, True))
    return results, "\n".join(lines)


# For the presets' tokenizer, whose only special token is <|endoftext|>.
PLAIN_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] + "
                       "'<|endoftext|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def suite_packing(args) -> tuple[list[dict], str]:
    """2-process FSDP SFT, packed against padded; real tokens/s."""
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "chat.jinja"
        template.write_text(PLAIN_CHAT_TEMPLATE)

        def run_case(packing: bool, round_index: int) -> dict:
            name = "packing" if packing else "padding"
            print(f"[bench] {name}, fsdp.yaml, 2 processes", flush=True)
            run_dir = Path(tmp) / f"{name}-{round_index}"
            launch("fsdp.yaml", 2, [*train_args(args, run_dir, args.batch), "--dataset", "builtin", "--data_format",
                                    "chat", "--chat_template", str(template), "--packing", str(packing).lower()],
                   args.mixed_precision)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            timed = [r for r in rows if "loss" in r][2:]  # after 2 warm-up steps
            seconds = sum(r["step_time_s"] for r in timed)
            return {"case": name, "step_time_s": statistics.median(r["step_time_s"] for r in timed),
                    "tokens_per_sec": sum(r["tokens_per_sec"] * r["step_time_s"] for r in timed) / seconds}

        results = fastest_rounds([True, False], run_case, args.rounds)
    packed, padded = results
    lines = [f"model {args.model}, {args.steps} steps, 2 x {args.batch} rows of up to {args.block_size} tokens, "
             f"fsdp.yaml, {args.mixed_precision}, fastest of {args.rounds} round(s)", "",
             "| case | step time (s) | real tokens/s |", "| --- | --- | --- |"]
    lines += [f"| {r['case']} | {r['step_time_s']:.3f} | {r['tokens_per_sec']:,.0f} |" for r in results]
    lines += ["", f"packing / padding: {packed['tokens_per_sec'] / padded['tokens_per_sec']:.2f}x real tokens/s"]
    return results, "\n".join(lines)


def stream_corpus(root: Path, name: str, shards: int, copies: int = 5) -> Path:
    """The built-in corpus `copies` times over, as `shards` .jsonl.gz files."""
    from finetune.data.builtin import build_stdlib_corpus

    lines = build_stdlib_corpus().read_text().splitlines(keepends=True) * copies
    folder = root / name
    folder.mkdir()
    per = -(-len(lines) // shards)
    for shard in range(shards):
        with gzip.open(folder / f"train-{shard:05d}.jsonl.gz", "wt") as f:
            f.writelines(lines[shard * per:(shard + 1) * per])
    return folder


def pipeline_rate(args, corpus: Path, tokenizer_dir: Path, workers: int) -> dict:
    """What rank 0 of 2 reads, tokenizes and cuts into blocks, alone in this
    process: tokens/s over the first --data_tokens (or the pass), and the
    memory it holds (unique set: above this process's, and in each worker)."""
    import psutil
    from transformers import AutoTokenizer

    from finetune.config import load_config
    from finetune.data.mixture import MixedRows
    from finetune.data.text import load_sources

    cfg = load_config(None, {"model": args.model, "dataset": str(corpus), "streaming": True, "max_steps": 1,
                             "block_size": args.block_size, "max_eval_samples": 1}).resolved()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    loaded = load_sources(cfg, rank=0, world_size=2)
    stream = MixedRows(loaded, tokenizer, cfg).stream(rank=0, workers=workers)
    process = psutil.Process()
    before, held, in_workers = process.memory_full_info().uss, 0, []
    start, count = time.perf_counter(), 0
    for rows, (row, _) in enumerate(stream.rows(0), 1):
        count += len(row["input_ids"])
        if rows % 1000 == 0:
            held = max(held, process.memory_full_info().uss - before)
            in_workers = [child.memory_full_info().uss for child in process.children()]
        if count >= args.data_tokens:
            break
    seconds = time.perf_counter() - start
    stream.close()
    return {"tokens_per_sec": count / seconds, "held_bytes": held, "worker_bytes": in_workers}


def suite_data(args) -> tuple[list[dict], str]:
    """The stream's data pipeline against what training consumes, on the same
    corpus: 2-process FSDP with --streaming and without, then the pipeline of
    one of the streamed ranks alone, with 4 shards (2 per rank) and with 3
    (which 2 ranks do not divide: each reads all 3 and keeps every other example)."""
    with tempfile.TemporaryDirectory() as tmp:
        corpus = stream_corpus(Path(tmp), "four", shards=4)
        trained = {}
        for streaming in (True, False):
            run_dir = Path(tmp) / ("streamed" if streaming else "map-style")
            print(f"[bench] training {args.model}, {run_dir.name}, fsdp.yaml, 2 processes", flush=True)
            launch("fsdp.yaml", 2, [*train_args(args, run_dir, args.batch), "--dataset", str(corpus),
                                    *(["--streaming"] if streaming else [])], args.mixed_precision)
            trained[run_dir.name] = measure(run_dir)
        # The tokenizer the runs used: a preset's own, saved in its run dir; else the model's.
        run_dir = Path(tmp) / "streamed"
        tokenizer_dir = run_dir / "tokenizer" if (run_dir / "tokenizer").is_dir() else Path(model_source(args.model))
        consumed = trained["streamed"]["tokens_per_sec"] / 2
        results = [{"case": f"training, {name}, per rank", "tokens_per_sec": result["tokens_per_sec"] / 2,
                    "vs_training": result["tokens_per_sec"] / 2 / consumed,
                    "peak_memory_bytes_per_rank": result["peak_memory_bytes_per_rank"]}
                   for name, result in trained.items()]
        three = stream_corpus(Path(tmp), "three", shards=3)
        for shards, workers in ((corpus, 0), (corpus, args.data_workers), (three, 0)):
            case = f"data pipeline, {shards.name} shards over 2 ranks, {workers} worker(s)"
            print(f"[bench] {case}", flush=True)
            rate = pipeline_rate(args, shards, tokenizer_dir, workers)
            results.append({"case": case, **rate, "vs_training": rate["tokens_per_sec"] / consumed})
    lines = [f"model {args.model}, {args.steps} steps, 2 x {args.batch} blocks of {args.block_size} tokens, fsdp.yaml, "
             f"{args.mixed_precision}; the corpus: the built-in one x5 in .jsonl.gz shards", "",
             "| case | tokens/s | vs streamed training | peak RSS per rank (bytes) | data held (bytes, USS) |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        peak = ", ".join(f"{b:,}" for b in r.get("peak_memory_bytes_per_rank", [])) or "-"
        held = (f"{r['held_bytes']:,}" + "".join(f" + worker {b:,}" for b in r["worker_bytes"])
                if "held_bytes" in r else "-")
        lines.append(f"| {r['case']} | {r['tokens_per_sec']:,.0f} | {r['vs_training']:.1f}x | {peak} | {held} |")
    slowest = min(r["vs_training"] for r in results if "held_bytes" in r)
    lines += ["", target_line("data pipeline vs training (tokens/s, per rank)", slowest, 1.0, higher_is_better=True)]
    return results, "\n".join(lines)


def suite_loss(args) -> tuple[list[dict], str]:
    """Full logits against the chunked loss (and, with --baseline_ref, that
    commit as it was), 1 process, profiled after 2 warm-up steps."""
    from finetune.config import TrainConfig

    with tempfile.TemporaryDirectory() as tmp, checkouts(args.baseline_ref, tmp) as dirs:
        cases = [(label, None) for label in dirs if label != "this checkout"]
        cases += [("this checkout", 0), ("this checkout", TrainConfig().loss_chunk_size)]

        def run_case(case: tuple[str, int | None], round_index: int) -> dict:
            label, chunk = case
            name = label if chunk is None else "full logits" if chunk == 0 else f"chunked ({chunk} positions)"
            print(f"[bench] {name}, 1 process", flush=True)
            run_dir = Path(tmp) / f"{list(dirs).index(label)}-{chunk}-{round_index}"
            option = [] if chunk is None else ["--loss_chunk_size", str(chunk)]
            launch("single.yaml", 1, [*train_args(args, run_dir, args.batch, profile=True), *option],
                   args.mixed_precision, threads=os.cpu_count(), checkout=dirs[label])
            breakdown = json.loads((run_dir / "profile" / "rank0_breakdown.json").read_text())
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            return {"case": name, "losses": [r["loss"] for r in rows if "loss" in r],
                    "step_time_s": statistics.median(r["step_time_s"] for r in rows if "loss" in r),
                    "peak_step_allocation_bytes": breakdown["peak_step_allocation_bytes"]}

        results = fastest_rounds(cases, run_case, args.rounds)
    before, chunked = results[0], results[-1]
    lines = [f"model {args.model}, {args.steps} steps ({args.steps - 2} profiled), batch {args.batch} x "
             f"{args.block_size} tokens, 1 process, {args.mixed_precision}, fastest of {args.rounds} round(s)", "",
             f"| case | step time (s) | torch peak step allocation (bytes) | vs {before['case']} | "
             "largest relative loss difference |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        worst = max(abs(a - b) / abs(a) for a, b in zip(before["losses"], r["losses"]))
        r["largest_relative_loss_difference"] = worst
        lines.append(f"| {r['case']} | {r['step_time_s']:.3f} | {r['peak_step_allocation_bytes']} | "
                     f"{r['peak_step_allocation_bytes'] / before['peak_step_allocation_bytes']:.2f} | {worst:.1e} |")
    ratio = chunked["peak_step_allocation_bytes"] / before["peak_step_allocation_bytes"]
    lines += ["", "targets:", target_line(f"{chunked['case']} / {before['case']} peak step allocation", ratio, 0.70, False),
              target_line("largest relative loss difference (x 1e5)",
                          chunked["largest_relative_loss_difference"] * 1e5, 1.0, False)]
    return results, "\n".join(lines)


def suite_lora(args) -> tuple[list[dict], str]:
    """FSDP (fsdp.yaml): a full fine-tune against LoRA (all-linear, rank
    --lora_r) of the same model, interleaved, and QLoRA (LoRA on the 4-bit
    base) where there is a CUDA GPU; per-rank state and peak memory, step time.
    2 processes on CPU, one per GPU on a GPU machine."""
    import torch

    nproc = torch.cuda.device_count() if on_gpu() else 2
    pefts = ["none", "lora", "qlora"] if on_gpu() else ["none", "lora"]
    names = {"none": "full fine-tune", "lora": f"LoRA r={args.lora_r}", "qlora": f"QLoRA r={args.lora_r}"}
    with tempfile.TemporaryDirectory() as tmp:
        def run_case(peft: str, round_index: int) -> dict:
            print(f"[bench] {names[peft]}, fsdp.yaml, {nproc} process(es)", flush=True)
            run_dir = Path(tmp) / f"{peft}-{round_index}"
            option = [] if peft == "none" else ["--peft", peft, "--lora_r", str(args.lora_r)]
            launch("fsdp.yaml", nproc, [*train_args(args, run_dir, args.batch), *option], args.mixed_precision)
            summary = json.loads((run_dir / "summary.json").read_text())
            return {"case": names[peft], **measure(run_dir), "trainable_params": summary["trainable_params"]}

        results = fastest_rounds(pefts, run_case, args.rounds)
    full = results[0]
    lines = [f"model {args.model}, {args.steps} steps, {nproc} x {args.batch} x {args.block_size} tokens, fsdp.yaml, "
             f"{args.mixed_precision}, fastest of {args.rounds} round(s); bytes per rank", "",
             "| case | trainable parameters | state (params + grads + AdamW) | peak memory | step time (s) |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['case']} | {r['trainable_params']:,} | {' / '.join(f'{b:,}' for b in r['state_bytes_per_rank'])} | "
              f"{' / '.join(f'{b:,}' for b in r['peak_memory_bytes_per_rank'])} | {r['step_time_s']:.3f} |"
              for r in results]
    lines.append("")
    lines += [f"{r['case']} / full: state {max(r['state_bytes_per_rank']) / max(full['state_bytes_per_rank']):.2f}x, "
              f"peak memory {max(r['peak_memory_bytes_per_rank']) / max(full['peak_memory_bytes_per_rank']):.2f}x, "
              f"step time {r['step_time_s'] / full['step_time_s']:.2f}x" for r in results[1:]]
    return results, "\n".join(lines)


def preference_model_and_pairs(args, root: Path, count: int = 256) -> tuple[Path, Path]:
    """The built-in preference pairs as strings (question, its docstring answer,
    another function's), and a model dir both tools start from: --model's, or
    the preset built from seed 42 with a tokenizer trained on the pairs."""
    import torch

    from finetune import models
    from finetune.data.builtin import build_stdlib_preferences
    from finetune.data.tokenizer import load_preset_tokenizer, save_bpe_tokenizer
    from finetune.presets import GPT2_PRESETS
    from datasets import Dataset

    rows = [json.loads(line) for line in build_stdlib_preferences().read_text().splitlines()[:count]]
    pairs = [{"prompt": r["prompt"][0]["content"] + "\n", "chosen": r["chosen"][0]["content"],
              "rejected": r["rejected"][0]["content"]} for r in rows]
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    if args.model not in GPT2_PRESETS:
        return model_source(args.model), data
    model_dir = root / "model"
    save_bpe_tokenizer(Dataset.from_list(pairs), GPT2_PRESETS[args.model]["vocab_size"], model_dir)
    tokenizer = load_preset_tokenizer(model_dir, args.model)
    torch.manual_seed(42)
    models.build_gpt2(models.gpt2_config(GPT2_PRESETS[args.model], tokenizer.bos_token_id,
                                         tokenizer.eos_token_id)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, data


# Each preference suite: our objective, the rows it reads (from the pairs), its cases, TRL's trainer.
PREFERENCE_SUITES = {
    "dpo": ("DPO", "pairs", ["finetune DPO", "finetune DPO, precomputed reference"], "DPOTrainer"),
    "kto": ("KTO", "labelled completions", ["finetune KTO"], "KTOTrainer"),
    "reward": ("reward model", "pairs", ["finetune reward model"], "RewardTrainer"),
}


def suite_preference(args, objective: str) -> tuple[list[dict], str]:
    """Full DPO, KTO or a reward model, 2 processes under fsdp.yaml, same model,
    data, batch and steps: our loop (DPO: its reference sharded as the policy,
    and precomputed) against TRL's trainer (`pip install trl`, a bench-only
    dependency) under the same launch. KTO reads each pair as its two labelled
    completions."""
    name, rows_name, our_cases, trainer = PREFERENCE_SUITES[objective]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = preference_model_and_pairs(args, Path(tmp))
        if objective == "kto":
            pairs = [json.loads(line) for line in data.read_text().splitlines()]
            data = Path(tmp) / "unpaired.jsonl"
            data.write_text("".join(json.dumps({"prompt": p["prompt"], "completion": p[side],
                                                "label": side == "chosen"}) + "\n"
                                    for p in pairs for side in ("chosen", "rejected")))
        ours_args = ["--model", str(model_dir), "--dataset", str(data), "--method", objective,
                     "--max_steps", str(args.steps), "--block_size", str(args.block_size),
                     "--per_device_batch_size", str(args.batch), "--max_eval_batches", "1", "--sample_prompt", ""]

        def run_case(case: str, round_index: int) -> dict:
            print(f"[bench] {case}, fsdp.yaml, 2 processes", flush=True)
            run_dir = Path(tmp) / f"{case.replace(' ', '-')}-{round_index}"
            if case.startswith("TRL"):
                return run_trl(case, "bench_trl_preference.py", [objective, model_dir, data, run_dir, args.batch,
                                                                 args.steps, args.block_size], run_dir, args)[0]
            extra = ["--precompute_reference"] if "precomputed" in case else []
            launch("fsdp.yaml", 2, [*ours_args, *extra, "--output_dir", str(run_dir)], args.mixed_precision)
            return {"case": case, **measure(run_dir)}

        results = fastest_rounds([*our_cases, f"TRL {trainer}"], run_case, args.rounds)
    ours = results[0]
    rows_per_step = 2 * args.batch
    tokens_per_row = ours["tokens_per_sec"] * ours["step_time_s"] / rows_per_step
    lines = [f"model {args.model}, {args.steps} steps, 2 x {args.batch} {rows_name} of the built-in preference set as "
             f"strings (at most {args.block_size} tokens a sequence), fsdp.yaml, {args.mixed_precision}, "
             f"fastest of {args.rounds} round(s); memory in bytes per rank", "",
             f"| case | layout | step time (s) | {rows_name}/s | tokens/s | peak memory per rank | vs TRL ({rows_name}/s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    trl = results[-1]
    for r in results:
        if r.get("failed"):
            lines.append(f"| {r['case']} | | failed: {r['failed']} | | | | |")
            continue
        rows_per_sec = rows_per_step / r["step_time_s"]
        versus = (f"{trl['step_time_s'] / r['step_time_s']:.2f}" if not trl.get("failed") else "-")
        layout = f"{r['distributed_type']}, parameters per rank {' / '.join(f'{n:,}' for n in r['local_params_per_rank'])}"
        lines.append(f"| {r['case']} | {layout} | {r['step_time_s']:.3f} | {rows_per_sec:.1f} | "
                     f"{rows_per_sec * tokens_per_row:,.0f} | "
                     f"{' / '.join(f'{b:,}' for b in r['peak_memory_bytes_per_rank'])} | {versus} |")
    lines += ["", f"tokens/s: {rows_name}/s times the tokens of one as our run counted them; step time: the median, "
                  f"between step ends, after the first steps; {name}"]
    return results, "\n".join(lines)


def grpo_model_and_prompts(args, root: Path, count: int = 512) -> tuple[Path, Path]:
    """The built-in "which module defines X" prompts as strings with their
    answers, and a model dir both tools start from (as for --suite dpo)."""
    import torch

    from finetune import models
    from finetune.data.builtin import build_stdlib_module_questions
    from finetune.data.tokenizer import load_preset_tokenizer, save_bpe_tokenizer
    from finetune.presets import GPT2_PRESETS
    from datasets import Dataset

    rows = [json.loads(line) for line in build_stdlib_module_questions().read_text().splitlines()]
    rows = random.Random(0).sample(rows, count)
    prompts = [{"prompt": r["prompt"][0]["content"] + "\n", "answer": r["answer"]} for r in rows]
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    if args.model not in GPT2_PRESETS:
        return Path(model_source(args.model)), data
    model_dir = root / "model"
    save_bpe_tokenizer(Dataset.from_list([{"text": p["prompt"] + p["answer"]} for p in prompts]),
                       GPT2_PRESETS[args.model]["vocab_size"], model_dir)
    tokenizer = load_preset_tokenizer(model_dir, args.model)
    torch.manual_seed(42)
    models.build_gpt2(models.gpt2_config(GPT2_PRESETS[args.model], tokenizer.bos_token_id,
                                         tokenizer.eos_token_id)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, data


def suite_grpo(args) -> tuple[list[dict], str]:
    """GRPO, 2 processes under fsdp.yaml, the same model, prompts, reward
    (finetune's exact_match), group size, completion length, batch, learning rate
    and steps: our loop (sampling from the sharded model, and from a replica;
    and under ddp.yaml) against TRL's GRPOTrainer (transformers' generate, no
    vLLM; `pip install trl`) under the same launch."""
    completions = 2 * args.batch  # per step, both ranks
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = grpo_model_and_prompts(args, Path(tmp))

        def run_case(case: str, round_index: int) -> dict:
            print(f"[bench] {case}, 2 processes", flush=True)
            run_dir = Path(tmp) / f"{case.replace(' ', '-').replace(',', '')}-{round_index}"
            if case.startswith("TRL"):
                result, ranks = run_trl(case, "bench_trl_grpo.py", [model_dir, data, run_dir, args.batch,
                                        args.num_generations, args.max_completion_length, args.steps,
                                        args.grpo_learning_rate], run_dir, args)
                if ranks:
                    result.update(rewards=ranks[0]["rewards"],
                                  completion_length=statistics.mean(ranks[0]["completion_lengths"]))
                return result
            config = "ddp.yaml" if "DDP" in case else "fsdp.yaml"
            engine = "replica" if "replica" in case else "sharded"
            launch(config, 2, ["--model", str(model_dir), "--dataset", str(data), "--method", "grpo",
                                    "--generation_engine", engine,
                                    "--reward_funcs", "exact_match", "--num_generations", str(args.num_generations),
                                    "--max_completion_length", str(args.max_completion_length),
                                    "--per_device_batch_size", str(args.batch), "--max_steps", str(args.steps),
                                    "--learning_rate", str(args.grpo_learning_rate), "--lr_scheduler_type", "constant",
                                    "--warmup_ratio", "0", "--block_size", str(args.block_size),
                                    "--max_eval_batches", "1", "--sample_prompt", "", "--output_dir", str(run_dir)],
                   args.mixed_precision)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            trained = [r for r in rows if "loss" in r]
            timed = trained[1:] or trained  # after the first step
            return {"case": case, **measure(run_dir), "rewards": [r["reward"] for r in trained],
                    "completion_length": statistics.mean(r["completions/mean_length"] for r in trained),
                    "rollout_time": statistics.median(r["rollout_time"] for r in timed),
                    "train_time": statistics.median(r["train_time"] for r in timed)}

        # On a CPU, Accelerate runs TRL's Trainer as DDP whatever the launch says: our DDP run is the like-for-like one.
        cases = ["finetune GRPO, sharded", "finetune GRPO, replica", "finetune GRPO, DDP", "TRL GRPOTrainer"]
        results = fastest_rounds(cases, run_case, args.rounds)
    lines = [f"model {args.model}, {args.steps} steps, 2 x {args.batch} completions a step ({args.num_generations} per "
             f"prompt, at most {args.max_completion_length} tokens) of the built-in module questions, reward "
             f"exact_match, learning rate {args.grpo_learning_rate}, fsdp.yaml (ddp.yaml where named), {args.mixed_precision}, fastest of "
             f"{args.rounds} round(s); memory in bytes per rank", "",
             "| case | layout | step time (s) | rollout / train time (s) | completion tokens generated/s | tokens "
             "trained/s | peak memory per rank | reward, step by step | vs TRL (step time) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    trl = results[-1]
    for r in results:
        if r.get("failed"):
            lines.append(f"| {r['case']} | | failed: {r['failed']} | | | | | | |")
            continue
        generated = completions * r["completion_length"] / r["step_time_s"]
        split = f"{r['rollout_time']:.3f} / {r['train_time']:.3f}" if "rollout_time" in r else "-"
        trained = f"{r['tokens_per_sec']:,.0f}" if "tokens_per_sec" in r else "-"
        versus = f"{trl['step_time_s'] / r['step_time_s']:.2f}" if not trl.get("failed") else "-"
        layout = f"{r['distributed_type']}, parameters per rank {' / '.join(f'{n:,}' for n in r['local_params_per_rank'])}"
        lines.append(f"| {r['case']} | {layout} | {r['step_time_s']:.3f} | {split} | {generated:,.0f} | {trained} | "
                     f"{' / '.join(f'{b:,}' for b in r['peak_memory_bytes_per_rank'])} | "
                     f"{' '.join(f'{x:.2f}' for x in r['rewards'])} | {versus} |")
    lines += ["", "step time: the median between step ends after the first steps, generation included; rollout / "
                  "train time: our runs' medians of `rollout_time` (sampling and the weight sync) and `train_time` (the "
                  "forwards, backwards and optimizer step after it); tokens "
                  "generated: completions a step x their mean length (each tool's own) / step time; tokens trained: "
                  "prompt and completion tokens of our steps (TRL's Trainer does not log them)"]
    return results, "\n".join(lines)


def moe_model_and_texts(args, root: Path, count: int = 2000) -> tuple[Path, Path]:
    """A Qwen3-MoE (8 experts, 2 a token, 4 layers of width 256) built from
    seed 42 with a tokenizer trained on the built-in corpus, and that corpus's
    first documents as a JSON Lines file of texts: what both tools train on."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from finetune.data.builtin import build_stdlib_corpus
    from finetune.data.tokenizer import load_preset_tokenizer, save_bpe_tokenizer

    paragraphs = [json.loads(line)["text"] for line in build_stdlib_corpus().read_text().splitlines()[:count]]
    texts = root / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    model_dir = root / "moe"
    save_bpe_tokenizer(Dataset.from_list([{"text": p} for p in paragraphs]), 4096, model_dir)
    tokenizer = load_preset_tokenizer(model_dir, "small-gpt2")
    torch.manual_seed(42)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, texts


def suite_moe(args) -> tuple[list[dict], str]:
    """SFT of a mixture of experts with its load-balancing loss, 2 processes
    under fsdp.yaml, same model, texts, batch and steps: our loop against
    TRL's SFTTrainer (`pip install trl`, a bench-only dependency)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, texts = moe_model_and_texts(args, Path(tmp))

        def run_case(case: str, round_index: int) -> dict:
            print(f"[bench] {case}, fsdp.yaml, 2 processes", flush=True)
            run_dir = Path(tmp) / f"{case.replace(' ', '-')}-{round_index}"
            if case.startswith("TRL"):
                return run_trl(case, "bench_trl_moe.py", [model_dir, texts, run_dir, args.batch, args.steps,
                                                          args.block_size], run_dir, args)[0]
            launch("fsdp.yaml", 2, ["--model", str(model_dir), "--dataset", str(texts), "--data_format", "text",
                                    "--max_steps", str(args.steps), "--block_size", str(args.block_size),
                                    "--per_device_batch_size", str(args.batch), "--learning_rate", "1e-4",
                                    "--output_router_logits", "--max_eval_batches", "1", "--sample_prompt", "",
                                    "--output_dir", str(run_dir)], args.mixed_precision)
            return {"case": case, **measure(run_dir)}

        results = fastest_rounds(["finetune SFT", "TRL SFTTrainer"], run_case, args.rounds)
    ours, trl = results
    tokens_per_step = ours["tokens_per_sec"] * ours["step_time_s"]
    lines = [f"Qwen3-MoE of 8 experts (2 a token), 4 layers of width 256, with its load-balancing loss; "
             f"{args.steps} steps of 2 x {args.batch} blocks of {args.block_size} tokens of the built-in corpus, "
             f"fsdp.yaml, {args.mixed_precision}, fastest of {args.rounds} round(s); memory in bytes per rank", "",
             "| case | layout | step time (s) | tokens/s | peak memory per rank | step time vs TRL |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if r.get("failed"):
            lines.append(f"| {r['case']} | | failed: {r['failed']} | | | |")
            continue
        versus = f"{r['step_time_s'] / trl['step_time_s']:.2f}" if not trl.get("failed") else "-"
        layout = f"{r['distributed_type']}, parameters per rank {' / '.join(f'{n:,}' for n in r['local_params_per_rank'])}"
        lines.append(f"| {r['case']} | {layout} | {r['step_time_s']:.3f} | {tokens_per_step / r['step_time_s']:,.0f} | "
                     f"{' / '.join(f'{b:,}' for b in r['peak_memory_bytes_per_rank'])} | {versus} |")
    lines += ["", "tokens/s: the tokens of our step (2 x batch x block size) over each step time; step time: the "
                  "median, between step ends, after the first steps"]
    return results, "\n".join(lines)


def vlm_model_and_rows(args, root: Path, count: int = 512) -> tuple[Path, Path, Path]:
    """A LLaVA (a 4-layer CLIP tower and Llama of width 128, 28-pixel images of
    4 tokens) built from seed 42 with the tests' processor, the drawn shapes as
    our data file (paths relative to it), and the same rows with absolute image
    paths for TRL (whose processor opens them from its working dir)."""
    sys.path.insert(0, str(REPO / "tests"))
    from vlm_models import save_vlm_model

    from finetune.data.shapes import build_shapes

    rows = build_shapes(count=count, cache=root)
    model_dir = save_vlm_model(root / "llava", "llava", seed=42, width=128, layers=4)
    absolute = root / "trl-rows.jsonl"
    absolute.write_text(rows.read_text().replace('"images/', f'"{rows.parent}/images/'))
    return model_dir, rows, absolute


def suite_vlm(args) -> tuple[list[dict], str]:
    """Image chat SFT, 2 processes under fsdp.yaml (and ours under ddp.yaml),
    the same LLaVA, drawn images, batch and steps: our loop against TRL's
    SFTTrainer with its vision-language collator (`pip install trl`)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, rows, trl_rows = vlm_model_and_rows(args, Path(tmp))

        def run_case(case: str, round_index: int) -> dict:
            print(f"[bench] {case}, 2 processes", flush=True)
            run_dir = Path(tmp) / f"{case.replace(' ', '-').replace(',', '')}-{round_index}"
            if case.startswith("TRL"):
                return run_trl(case, "bench_trl_vlm.py", [model_dir, trl_rows, run_dir, args.batch, args.steps],
                               run_dir, args)[0]
            launch("ddp.yaml" if "DDP" in case else "fsdp.yaml", 2,
                   ["--task", "image-text-to-text", "--model", str(model_dir), "--dataset", str(rows),
                    "--max_steps", str(args.steps), "--per_device_batch_size", str(args.batch), "--learning_rate", "1e-4",
                    "--block_size", "256", "--freeze_vision_tower", "false", "--max_eval_batches", "1",
                    "--output_dir", str(run_dir)], args.mixed_precision)
            return {"case": case, **measure(run_dir)}

        # On a CPU, Accelerate runs TRL's Trainer as DDP whatever the launch says: our DDP run is the like-for-like one.
        results = fastest_rounds(["finetune SFT, FSDP2", "finetune SFT, DDP", "TRL SFTTrainer"], run_case, args.rounds)
    trl = results[-1]
    images = 2 * args.batch  # one image a row
    lines = [f"LLaVA (CLIP tower and Llama, 4 layers of width 128 each, 28-pixel images of 4 tokens), every weight "
             f"trained; {args.steps} steps of 2 x {args.batch} drawn-shape conversations, fsdp.yaml (ddp.yaml where "
             f"named), {args.mixed_precision}, fastest of {args.rounds} round(s); memory in bytes per rank", "",
             "| case | layout | step time (s) | images/s | peak memory per rank | vs TRL (step time) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if r.get("failed"):
            lines.append(f"| {r['case']} | | failed: {r['failed']} | | | |")
            continue
        versus = f"{trl['step_time_s'] / r['step_time_s']:.2f}" if not trl.get("failed") else "-"
        layout = f"{r['distributed_type']}, parameters per rank {' / '.join(f'{n:,}' for n in r['local_params_per_rank'])}"
        lines.append(f"| {r['case']} | {layout} | {r['step_time_s']:.3f} | {images / r['step_time_s']:,.1f} | "
                     f"{' / '.join(f'{b:,}' for b in r['peak_memory_bytes_per_rank'])} | {versus} |")
    lines += ["", "step time: the median between step ends after the first steps, image decoding and processing "
                  "included; images/s: the step's images (2 x batch) over it; vs TRL: TRL's step time over the case's"]
    return results, "\n".join(lines)


def timed(cmd: list[str], cwd: Path, until: Path | None = None) -> float:
    """Seconds until `cmd` exits, or with `until` until that file holds a
    training row (the process is then left to finish, untimed)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=checkout_env(cwd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = None
    while proc.poll() is None:
        if until is not None and until.exists() and '"loss"' in until.read_text():
            elapsed = time.perf_counter() - start
            break
        time.sleep(0.01)
    stderr = proc.communicate()[1]
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed in {cwd}:\n{stderr[-3000:]}")
    return elapsed if elapsed is not None else time.perf_counter() - start


def suite_startup(args) -> tuple[list[dict], str]:
    """Launch to first step, generate and export, per checkout (this one and --baseline_ref)."""
    python = sys.executable
    figures = ("launch_to_first_step_s", "generate_s", "export_s")
    with tempfile.TemporaryDirectory() as tmp, checkouts(args.baseline_ref, tmp) as dirs:
        rounds_of: dict[str, list[dict]] = {name: [] for name in dirs}

        def run_case(name: str, round_index: int) -> dict:
            cwd, run_dir = dirs[name], Path(tmp) / f"{list(dirs).index(name)}-{round_index}"
            print(f"[bench] start-up, {name}", flush=True)
            train = [python, "-m", "accelerate.commands.launch", "--config_file",
                     str(cwd / "accelerate_configs" / "fsdp.yaml"), "--num_processes", "2", "-m", "finetune",
                     "train", "--model", "tiny-gpt2", "--max_steps", "2", "--max_eval_batches", "1",
                     "--sample_prompt", "", "--output_dir", str(run_dir)]
            first_step = timed(train, cwd, until=run_dir / "metrics.jsonl")
            generate = timed([python, "-m", "finetune", "generate", str(run_dir / "final"), "--prompt", "The",
                              "--max_new_tokens", "8"], cwd)
            export = timed([python, "-m", "finetune", "export", str(run_dir), "--output",
                            str(run_dir.with_name(run_dir.name + "-exported"))], cwd)
            result = {"case": name, "step_time_s": first_step, "launch_to_first_step_s": first_step,
                      "generate_s": generate, "export_s": export}
            if round_index >= 0:
                rounds_of[name].append(result)
            return result

        run_case(next(iter(dirs)), -1)  # warm the caches (data, tokenizer, bytecode) before timing
        fastest_rounds(list(dirs), run_case, args.rounds)
        # Each figure's own fastest round: the commands are timed one after another, so one round's load
        # would otherwise ride on all three.
        final = [{"case": name, **{key: min(r[key] for r in rounds) for key in figures}}
                 for name, rounds in rounds_of.items()]
    lines = [f"tiny-gpt2, warm caches, each figure the fastest of {args.rounds} round(s) per case", "",
             "| checkout | launch to first step, fsdp.yaml x 2 (s) | generate (s) | export (s) |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['case']} | {r['launch_to_first_step_s']:.2f} | {r['generate_s']:.2f} | {r['export_s']:.2f} |"
              for r in final]
    ours = final[-1]
    lines += ["", "targets:", target_line("launch to first step (s)", ours["launch_to_first_step_s"], 8.0, False),
              target_line("generate (s)", ours["generate_s"], 4.0, False),
              target_line("export (s)", ours["export_s"], 4.0, False)]
    return final, "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["configs", "baselines", "packing", "loss", "startup", "lora", "dpo", "kto",
                                            "reward", "data", "grpo", "moe", "vlm"],
                        default=None,
                        help="one suite (default: configs; both with --quick)")
    parser.add_argument("--quick", action="store_true", help="both suites on tiny-gpt2 with few steps")
    parser.add_argument("--trainer_bf16", action="store_true", help="also time the Trainer in bf16")
    parser.add_argument("--model", default="gpt2-small",
                        help="a GPT-2 preset (default: the GPT-2 124M shape), or a causal LM's HF dir or GGUF file")
    parser.add_argument("--dataset", default="builtin")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per case (the first 2 are warm-up)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank at 2 ranks")
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--output_dir", default=str(REPO / "outputs" / "bench"))
    parser.add_argument("--rounds", type=int, default=1, help="run every case this many times, keep the fastest")
    parser.add_argument("--compile", action="store_true",
                        help="baselines: also time our loop with torch.compile (accelerate's inductor backend)")
    parser.add_argument("--profile", action="store_true", help="also table where each case's step time goes")
    parser.add_argument("--baseline_ref", default="",
                        help="startup, loss and configs: also run a git worktree of this commit (before and after)")
    parser.add_argument("--lora_r", type=int, default=16, help="lora: the adapters' rank")
    parser.add_argument("--data_workers", type=int, default=2, help="data: the pipeline's encoding workers")
    parser.add_argument("--data_tokens", type=int, default=2_000_000, help="data: tokens the pipeline is timed over")
    parser.add_argument("--num_generations", type=int, default=4, help="grpo: completions per prompt")
    parser.add_argument("--max_completion_length", type=int, default=16, help="grpo: most tokens per completion")
    parser.add_argument("--grpo_learning_rate", type=float, default=1e-5, help="grpo: both tools' learning rate")
    parser.add_argument("--only", default="",
                        help="run only the configs suite's cases whose config contains this (or one of these, comma-separated)")
    return parser


def main() -> None:
    args = build_parser().parse_args()

    start = time.perf_counter()
    suites = {"configs": suite_configs, "baselines": suite_baselines, "packing": suite_packing, "loss": suite_loss, "startup": suite_startup,
              "lora": suite_lora, "data": suite_data, "grpo": suite_grpo, "moe": suite_moe, "vlm": suite_vlm,
              **{name: functools.partial(suite_preference, objective=name) for name in PREFERENCE_SUITES}}
    if args.quick:
        args.model, args.steps = "tiny-gpt2", 8
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ([args.suite] if args.suite else ["configs", "baselines"] if args.quick else ["configs"]):
        results, table = suites[name](args)
        (out / f"{name}.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
        (out / f"{name}.md").write_text(table + "\n")
        print(table, flush=True)
    print(f"[bench] {time.perf_counter() - start:.0f} s; written under {out}")


if __name__ == "__main__":
    main()
