"""Benchmarks: every case runs in this one invocation, on the same model and data,
so the figures compare like with like. Results go to outputs/bench/ as a
markdown table and JSON.

    python scripts/bench.py --suite configs [--model small-gpt2] [--steps 12] [--mixed_precision no]

Suite `configs`: each CPU-capable accelerate config trains the same model on the
same blocks; reported per config: median step time (after 2 warm-up steps), its
ratio to DDP, per-rank peak memory (resident set on CPU, max_memory_allocated on
GPU) and per-rank persistent state (parameters + gradients + optimizer state,
measured after the first optimizer step), all in bytes.
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


def launch(config: str, nproc: int, train_args: list[str], mixed_precision: str) -> None:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / config),
           "--num_processes", str(nproc), "--mixed_precision", mixed_precision, "-m", "finetune", "train", *train_args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        sys.exit(f"{config} failed:\n{proc.stderr[-3000:]}")


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
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for config, nproc in CPU_CONFIGS.items():
            # The same global batch everywhere: 1 process takes both ranks' share.
            batch = args.batch * 2 // nproc
            run_dir = Path(tmp) / config
            train_args = ["--model", args.model, "--dataset", args.dataset, "--max_steps", str(args.steps),
                          "--block_size", str(args.block_size), "--per_device_batch_size", str(batch),
                          "--max_eval_batches", "1", "--sample_prompt", "", "--output_dir", str(run_dir)]
            print(f"[bench] {config} on {nproc} process(es)", flush=True)
            launch(config, nproc, train_args, args.mixed_precision)
            results.append({"config": config, **measure(run_dir)})
    ddp = next(r for r in results if r["config"] == "ddp.yaml")
    lines = [f"model {args.model}, {args.steps} steps, global batch {args.batch * 2} x {args.block_size} tokens, "
             f"mixed_precision {args.mixed_precision}", "",
             "| config | type | ranks | step time (s) | vs DDP | peak memory per rank (bytes) | state per rank (bytes) | state vs DDP |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['config']} | {r['distributed_type']} | {r['world_size']} | {r['step_time_s']:.3f} | "
                     f"{r['step_time_s'] / ddp['step_time_s']:.2f} | {', '.join(map(str, r['peak_memory_bytes_per_rank']))} | "
                     f"{', '.join(map(str, r['state_bytes_per_rank']))} | "
                     f"{max(r['state_bytes_per_rank']) / max(ddp['state_bytes_per_rank']):.2f} |")
    return results, "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["configs"], default="configs")
    parser.add_argument("--model", default="small-gpt2")
    parser.add_argument("--dataset", default="builtin")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank at 2 ranks")
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--output_dir", default=str(REPO / "outputs" / "bench"))
    args = parser.parse_args()

    start = time.perf_counter()
    results, table = suite_configs(args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.suite}.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    (out / f"{args.suite}.md").write_text(table + "\n")
    print(table)
    print(f"[bench] {time.perf_counter() - start:.0f} s; written to {out}/{args.suite}.md and .json")


if __name__ == "__main__":
    main()
