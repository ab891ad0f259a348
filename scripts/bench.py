"""Benchmarks: every case runs in this one invocation, on the same model and data,
so the figures compare like with like. Results go to outputs/bench/ as a
markdown table and JSON.

    python scripts/bench.py --suite configs [--model small-gpt2] [--steps 12] [--mixed_precision no]
    python scripts/bench.py --suite baselines [--model tiny-gpt2]
    python scripts/bench.py --quick          # both suites on tiny-gpt2, few steps (about 2 minutes here)

Suite `configs`: each CPU-capable accelerate config trains the same model on the
same blocks; reported per config: median step time (after 2 warm-up steps), its
ratio to DDP, per-rank peak memory (resident set on CPU, max_memory_allocated on
GPU) and per-rank persistent state (parameters + gradients + optimizer state,
measured after the first optimizer step), all in bytes.

Suite `baselines`: one process, same model, same blocks, same batch and
precision: our loop (`python -m finetune train`) against the Hugging Face
`Trainer`, the tool most users would otherwise reach for, and our loop in bf16
against fp32. Reported: median step time and tokens/s, and their ratios.

Both suites report model FLOPs utilisation: training FLOPs per token (6 x
parameters + 12 x layers x width x block, as nanoGPT counts them) times
tokens/s, over the device's matmul peak measured in this same invocation (the
faster of fp32 and bf16, per thread, times the cores the case uses; accelerate
launch gives each process one thread).

`--only NAME` runs the cases whose config or name contains NAME (the test suite
runs `--quick --suite configs --only single` so this script cannot rot).
"""

from __future__ import annotations

import argparse
import json
import os
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
}


def launch(config: str, nproc: int, train_args: list[str], mixed_precision: str, threads: int | None = None) -> None:
    """`accelerate launch` gives each process 1 thread unless told otherwise."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / config),
           "--num_processes", str(nproc), "--mixed_precision", mixed_precision]
    if threads:
        cmd += ["--num_cpu_threads_per_process", str(threads)]
    cmd += ["-m", "finetune", "train", *train_args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        sys.exit(f"{config} failed:\n{proc.stderr[-3000:]}")


def matmul_peak_flops(threads: int, dtype_name: str, n: int = 512, seconds: float = 0.5) -> float:
    """FLOP/s of an n x n matmul on this machine with this many threads, timed
    over about `seconds` (slow dtypes get fewer repetitions)."""
    import torch

    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or reps == 0:
        a @ b
        reps += 1
    torch.set_num_threads(previous)
    return 2 * n**3 * reps / elapsed


def train_flops_per_token(model: str, block_size: int, total_params: int) -> float:
    from finetune import models

    shape = models.GPT2_PRESETS[model]
    return 6 * total_params + 12 * shape["n_layer"] * shape["n_embd"] * block_size


def mfu(result: dict, args, cores: int, peaks: dict) -> float:
    """Model FLOPs utilisation against the device's peak: the faster of the fp32
    and bf16 matmul, per thread, times the cores the case uses. (On CPUs without
    native bf16 the bf16 matmul is far slower, so bf16 runs show what they waste.)"""
    for dtype in ("no", "bf16"):
        if dtype not in peaks:
            peaks[dtype] = matmul_peak_flops(1, dtype)
    flops = train_flops_per_token(args.model, args.block_size, result["total_params"]) * result["tokens_per_sec"]
    return flops / (max(peaks.values()) * cores)


def peaks_line(peaks: dict) -> str:
    return "matmul peak per core, measured in this run (512 x 512, FLOP/s): " + \
        ", ".join(f"{'fp32' if dtype == 'no' else dtype} {flops:,.0f}" for dtype, flops in peaks.items())


def measure(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["step_time_s"] for r in rows if "loss" in r][2:]
    return {
        "distributed_type": summary["distributed_type"],
        "world_size": summary["world_size"],
        "step_time_s": statistics.median(step_times),
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in rows if "loss" in r),
        "peak_memory_bytes_per_rank": summary["peak_memory_bytes_per_rank"],
        "state_bytes_per_rank": summary["state_bytes_per_rank"],
        "local_params_per_rank": summary["local_params_per_rank"],
        "total_params": summary["total_params"],
    }


def suite_configs(args) -> tuple[list[dict], str]:
    results, peaks = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for config, nproc in CPU_CONFIGS.items():
            if args.only and args.only not in config:
                continue
            # The same global batch everywhere: 1 process takes both ranks' share.
            batch = args.batch * 2 // nproc
            run_dir = Path(tmp) / config
            train_args = ["--model", args.model, "--dataset", args.dataset, "--max_steps", str(args.steps),
                          "--block_size", str(args.block_size), "--per_device_batch_size", str(batch),
                          "--max_eval_batches", "1", "--sample_prompt", "", "--output_dir", str(run_dir)]
            print(f"[bench] {config} on {nproc} process(es)", flush=True)
            launch(config, nproc, train_args, args.mixed_precision)
            result = {"config": config, **measure(run_dir)}
            result["mfu"] = mfu(result, args, cores=nproc, peaks=peaks)
            results.append(result)
    ddp = next((r for r in results if r["config"] == "ddp.yaml"), results[0])
    lines = [f"model {args.model}, {args.steps} steps, global batch {args.batch * 2} x {args.block_size} tokens, "
             f"mixed_precision {args.mixed_precision}", "",
             f"ratios against {ddp['config']}; MFU against the measured matmul peak of the cores each case uses", "",
             "| config | type | ranks | step time (s) | vs DDP | tokens/s | MFU | peak memory per rank (bytes) | "
             "state per rank (bytes) | state vs DDP |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['config']} | {r['distributed_type']} | {r['world_size']} | {r['step_time_s']:.3f} | "
                     f"{r['step_time_s'] / ddp['step_time_s']:.2f} | {r['tokens_per_sec']:,.0f} | {r['mfu']:.1%} | "
                     f"{', '.join(map(str, r['peak_memory_bytes_per_rank']))} | "
                     f"{', '.join(map(str, r['state_bytes_per_rank']))} | "
                     f"{max(r['state_bytes_per_rank']) / max(ddp['state_bytes_per_rank']):.2f} |")
    lines += ["", peaks_line(peaks)]
    return results, "\n".join(lines)


def trainer_step_times(run_dir: Path, args, mixed_precision: str) -> list[float]:
    """The HF Trainer on the blocks our run trained on (same tokenizer, data,
    split, seed), the same preset model, batch, LR and steps; step times from a
    callback, so start-up and data preparation are not counted."""
    import torch
    from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from finetune import models
    from finetune.data.text import load_raw_text, tokenize_and_group

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "tokenizer")
    blocks = tokenize_and_group(load_raw_text(args.dataset, "text", 0.05, 42), tokenizer, args.block_size)["train"]
    torch.manual_seed(42)
    model = models.build_gpt2_preset(args.model, tokenizer.bos_token_id, tokenizer.eos_token_id)

    class StepTimer(TrainerCallback):
        """Time between step ends, data loading included: what our loop logs as step_time_s."""

        def __init__(self):
            self.times, self.last = [], None

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now

    timer = StepTimer()
    training_args = TrainingArguments(
        output_dir=str(run_dir / "trainer"), per_device_train_batch_size=args.batch * 2, max_steps=args.steps,
        learning_rate=1e-3, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0, lr_scheduler_type="cosine",
        warmup_steps=1, bf16=mixed_precision == "bf16", use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=args.steps, disable_tqdm=True, dataloader_drop_last=True, seed=42)
    collate = lambda rows: {"input_ids": torch.stack([r["input_ids"] for r in rows]),  # noqa: E731
                            "labels": torch.stack([r["input_ids"] for r in rows])}
    Trainer(model=model, args=training_args, train_dataset=blocks, data_collator=collate,
            callbacks=[timer]).train()
    return timer.times


def suite_baselines(args) -> tuple[list[dict], str]:
    """1 process, global batch = args.batch * 2, the same for every case."""
    results, peaks = [], {}
    cores = os.cpu_count()
    with tempfile.TemporaryDirectory() as tmp:
        for mixed_precision in ("no", "bf16"):
            run_dir = Path(tmp) / f"ours-{mixed_precision}"
            train_args = ["--model", args.model, "--dataset", args.dataset, "--max_steps", str(args.steps),
                          "--block_size", str(args.block_size), "--per_device_batch_size", str(args.batch * 2),
                          "--max_eval_batches", "1", "--sample_prompt", "", "--output_dir", str(run_dir)]
            print(f"[bench] finetune loop, 1 process, {mixed_precision}", flush=True)
            # All cores, as the in-process Trainer has.
            launch("single.yaml", 1, train_args, mixed_precision, threads=os.cpu_count())
            result = {"case": f"finetune loop ({mixed_precision})", **measure(run_dir)}
            result["mfu"] = mfu(result, args, cores, peaks)
            results.append(result)
            if mixed_precision == "no" or args.trainer_bf16:
                print(f"[bench] HF Trainer, 1 process, {mixed_precision}", flush=True)
                times = trainer_step_times(run_dir, args, mixed_precision)[1:]
                step = statistics.median(times)
                result = {"case": f"HF Trainer ({mixed_precision})", "step_time_s": step,
                          "tokens_per_sec": args.batch * 2 * args.block_size / step,
                          "total_params": results[-1]["total_params"]}
                result["mfu"] = mfu(result, args, cores, peaks)
                results.append(result)
    by_case = {r["case"]: r for r in results}
    ours, trainer = by_case["finetune loop (no)"], by_case["HF Trainer (no)"]
    lines = [f"model {args.model}, {args.steps} steps, batch {args.batch * 2} x {args.block_size} tokens, 1 process", "",
             "| case | step time (s) | tokens/s | tokens/s vs HF Trainer (fp32) | MFU |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['case']} | {r['step_time_s']:.3f} | {r['tokens_per_sec']:,.0f} | "
                     f"{r['tokens_per_sec'] / trainer['tokens_per_sec']:.2f} | {r['mfu']:.1%} |")
    lines += ["", f"our loop / HF Trainer, fp32: {ours['tokens_per_sec'] / trainer['tokens_per_sec']:.2f}x tokens/s",
              f"our loop bf16 / fp32: {by_case['finetune loop (bf16)']['tokens_per_sec'] / ours['tokens_per_sec']:.2f}x tokens/s",
              peaks_line(peaks)]
    return results, "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["configs", "baselines"], default=None,
                        help="one suite (default: configs; both with --quick)")
    parser.add_argument("--quick", action="store_true", help="both suites on tiny-gpt2 with few steps")
    parser.add_argument("--trainer_bf16", action="store_true", help="also time the Trainer in bf16")
    parser.add_argument("--model", default="small-gpt2")
    parser.add_argument("--dataset", default="builtin")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank at 2 ranks")
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--output_dir", default=str(REPO / "outputs" / "bench"))
    parser.add_argument("--only", default="", help="run only the configs suite's cases whose config contains this")
    args = parser.parse_args()

    start = time.perf_counter()
    suites = {"configs": suite_configs, "baselines": suite_baselines}
    if args.quick:
        args.model, args.steps = "tiny-gpt2", 8
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ([args.suite] if args.suite else list(suites) if args.quick else ["configs"]):
        results, table = suites[name](args)
        (out / f"{name}.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
        (out / f"{name}.md").write_text(table + "\n")
        print(table, flush=True)
    print(f"[bench] {time.perf_counter() - start:.0f} s; written under {out}")


if __name__ == "__main__":
    main()
