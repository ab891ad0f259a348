"""Packed SFT on one GPU: our attention paths (the dense mask, flex attention,
flash-attention's varlen), Liger's kernels, LoRA and QLoRA, against TRL's
SFTTrainer with `padding_free`, on models of real shapes built from a seed;
then GRPO on the Qwen2.5-0.5B shape over the GPUs there are (2 at most): our
replica and vLLM engines against TRL's GRPOTrainer with vLLM colocated.
Run through scripts/gpu_bench.sh (its header lists what the device needs).

Every case trains the same chat data (the built-in stdlib questions, packed
best-fit into blocks of T tokens), one block per step, bf16, for the same
steps; each reports tokens/s, MFU against the GPU's measured bf16 matmul peak,
peak GPU memory and its last loss (the same data, so the losses must agree).
A case the device cannot run (no flash-attn, no Liger, no TRL) is a row that
says why. The table goes to outputs/gpu-bench/table.md.

    python scripts/gpu_bench.py            # the full run (GPU)
    python scripts/gpu_bench.py --smoke    # the same code paths on CPU, a tiny model, about a minute
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# The two shapes, as their configs on the Hub give them (no weights are fetched: built from a seed).
SHAPES = {
    "Llama-3.2-1B shape": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                         vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0)),
    "Qwen2.5-0.5B shape": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                         tie_word_embeddings=True, rope_theta=1000000.0)),
}
SMOKE_SHAPE = {"tiny Llama": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=1024))}


def chat_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1000, show_progress=False,
                                                       special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(out)
    return tokenizer


def save_model(family: str, shape: dict, data: Path, out: Path, positions: int) -> None:
    """A model of `shape` from seed 0 with a chat tokenizer trained on the data (its
    vocabulary is smaller than the shape's: the embedding keeps the shape's rows)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    texts = [m["content"] for line in data.read_text().splitlines() for m in json.loads(line)["messages"]]
    tokenizer = chat_tokenizer(texts, out)
    config = AutoConfig.for_model(family, **shape, max_position_embeddings=positions, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)


def last_error(proc: subprocess.CompletedProcess) -> str:
    """finetune's one-line error where there is one, else the last line naming an error."""
    lines = proc.stderr.splitlines()
    return next((line for line in lines if line.startswith("error:")),
                next((line for line in reversed(lines) if "rror" in line), "failed")).strip()[:160]


def our_case(name: str, options: list[str], model: Path, data: Path, block: int, steps: int, out: Path,
             mixed_precision: str) -> dict:
    run_dir = out / name.replace(" ", "-").replace(",", "").replace("(", "").replace(")", "")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "fsdp.yaml"),
           "--num_processes", "1", "--mixed_precision", mixed_precision, "-m", "finetune", "train",
           "--model", str(model), "--dataset", str(data), "--data_format", "chat", "--block_size", str(block),
           "--per_device_batch_size", "1", "--max_steps", str(steps), "--learning_rate", "1e-4",
           "--train_on_prompt", "true",  # TRL's loss on conversations: every token
           "--max_eval_batches", "1", "--sample_prompt", "", "--checkpoint_at_end", "false", "--log_format", "plain",
           "--overwrite", "--output_dir", str(run_dir), *options]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        return {"case": name, "failed": last_error(proc)}
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "loss" in r][2:] or [r for r in rows if "loss" in r]  # after 2 warm-up steps
    step = statistics.median(r["step_time_s"] for r in timed)
    return {"case": name, "step_time_s": step, "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in timed),
            "peak_memory_bytes": summary["peak_memory_bytes_per_rank"][0], "loss": timed[-1]["loss"],
            "params": summary["total_params"], "layout": f"{summary['distributed_type']}, {summary.get('peft', 'none')}"}


def trl_case(name: str, model: Path, data: Path, block: int, steps: int, out: Path, mixed_precision: str) -> dict:
    if importlib.util.find_spec("trl") is None:
        return {"case": name, "failed": "TRL is not installed (pip install trl)"}
    result = out / "trl.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_trl_sft.py"), str(model), str(data), str(out / "trl"),
           str(block), str(steps), mixed_precision, str(result)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        return {"case": name, "failed": last_error(proc)}
    return {"case": name, **json.loads(result.read_text())}


def cases(on_gpu: bool) -> list[tuple[str, list[str], str]]:
    """(name, options, why it cannot run here or "")."""
    gpu = "" if on_gpu else "needs a CUDA GPU"
    flash = gpu or ("" if importlib.util.find_spec("flash_attn") else "flash-attn is not installed")
    liger = gpu or ("" if importlib.util.find_spec("liger_kernel") else "liger-kernel is not installed")
    return [
        ("full, dense mask (sdpa)", ["--attn_implementation", "sdpa"], ""),
        ("full, flex attention", ["--attn_implementation", "flex_attention"], gpu),
        ("full, varlen (flash-attention)", ["--attn_implementation", "flash_attention_2"], flash),
        ("full, flex + Liger", ["--attn_implementation", "flex_attention", "--use_liger_kernel"], liger),
        ("LoRA r=16, dense mask (sdpa)", ["--peft", "lora", "--lora_r", "16", "--attn_implementation", "sdpa"], ""),
        ("LoRA r=16, flex attention", ["--peft", "lora", "--lora_r", "16", "--attn_implementation", "flex_attention"], gpu),
        ("QLoRA r=16, flex attention", ["--peft", "qlora", "--lora_r", "16", "--attn_implementation", "flex_attention"],
         gpu),
    ]


# completions a rank, per prompt, most tokens, block
GRPO_SIZES = {"gpu": ("16", "4", "128", "512"), "smoke": ("4", "2", "8", "64")}


def grpo_case(name: str, model: Path, prompts: Path, gpus: int, steps: int, out: Path, mixed_precision: str,
              size: str) -> dict:
    """GRPO on the module questions, rewarded by exact_match."""
    (batch, generations, length, block), rate = GRPO_SIZES[size], "1e-6"
    run_dir = out / name.replace(" ", "-").replace(",", "")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(REPO / "accelerate_configs" / "fsdp.yaml"), "--num_processes", str(gpus), "--mixed_precision",
              mixed_precision]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    if name.startswith("TRL"):
        cmd = [*launch, str(REPO / "scripts" / "bench_trl_grpo.py"), str(model), str(prompts), str(run_dir), batch,
               generations, length, str(steps), rate, mixed_precision, "vllm"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            return {"case": name, "failed": last_error(proc)}
        ranks = [json.loads((run_dir / f"rank-{r}.json").read_text()) for r in range(gpus)]
        step = statistics.median(max(times) for times in zip(*(r["step_times"][1:] for r in ranks)))
        return {"case": name, "step_time_s": step, "rollout_time": None, "peak_memory_bytes": ranks[0]["peak_rss_bytes"],
                "reward": ranks[0]["rewards"][-1]}
    engine = "vllm" if "vllm" in name else "replica"
    cmd = [*launch, "-m", "finetune", "train", "--model", str(model), "--dataset", str(prompts), "--method", "grpo",
           "--generation_engine", engine, "--reward_funcs", "exact_match", "--num_generations", generations,
           "--max_completion_length", length, "--per_device_batch_size", batch, "--max_steps", str(steps),
           "--learning_rate", rate, "--lr_scheduler_type", "constant", "--block_size", block,
           "--max_eval_batches", "1", "--sample_prompt", "", "--checkpoint_at_end", "false", "--log_format", "plain",
           "--overwrite", "--output_dir", str(run_dir)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"case": name, "failed": last_error(proc)}
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "loss" in r][1:] or [r for r in rows if "loss" in r]
    return {"case": name, "step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "rollout_time": statistics.median(r["rollout_time"] for r in timed),
            "peak_memory_bytes": summary["peak_memory_bytes_per_rank"][0], "reward": timed[-1]["reward"]}


def grpo_cases(on_gpu: bool) -> list[tuple[str, str]]:
    """(name, why it cannot run here or "")."""
    vllm = ("" if importlib.util.find_spec("vllm") else "vLLM is not installed") if on_gpu else "needs a CUDA GPU"
    trl = vllm or ("" if importlib.util.find_spec("trl") else "TRL is not installed")
    return [("GRPO, replica", ""), ("GRPO, vllm colocate", vllm), ("TRL GRPOTrainer, vllm colocate", trl)]


def grpo_prompts(out: Path) -> Path:
    from finetune.data.builtin import build_stdlib_module_questions

    rows = [json.loads(line) for line in build_stdlib_module_questions().read_text().splitlines()][:512]
    path = out / "grpo-prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"][0]["content"] + "\n", "answer": r["answer"]}) + "\n"
                            for r in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the same code paths on CPU with a tiny model")
    parser.add_argument("--steps", type=int, default=None, help="steps per case (default: 8; smoke: 3)")
    parser.add_argument("--output_dir", default=str(REPO / "outputs" / "gpu-bench"))
    args = parser.parse_args()
    import torch

    from bench import matmul_peak_flops  # scripts/ is this script's dir, first on sys.path
    from finetune.data.builtin import build_stdlib_questions

    on_gpu = torch.cuda.is_available() and not args.smoke
    if not args.smoke and not on_gpu:
        sys.exit("error: no GPU visible to torch; run with --smoke on a CPU")
    shapes, blocks = (SHAPES, (2048, 8192)) if not args.smoke else (SMOKE_SHAPE, (128,))
    steps = args.steps or (3 if args.smoke else 8)
    mixed_precision = "bf16" if on_gpu else "no"
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = build_stdlib_questions()
    peak = matmul_peak_flops(torch.get_num_threads(), mixed_precision if on_gpu else "no", seconds=1.0)
    device = torch.cuda.get_device_name(0) if on_gpu else "CPU"
    lines = [f"{device}; torch {torch.__version__}; {mixed_precision}; one process under fsdp.yaml; {steps} steps of "
             f"one packed block of the built-in chat questions; MFU against a measured matmul peak of "
             f"{peak / 1e12:.1f} TFLOP/s; memory: the run's peak (GPU: torch's max allocated)", "",
             "| model | tokens per block | case | step time (s) | tokens/s | MFU | peak memory (bytes) | last loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    results = []
    start = time.perf_counter()
    for shape_name, (family, shape) in shapes.items():
        model = out / shape_name.replace(" ", "-")
        if not (model / "config.json").is_file():
            save_model(family, shape, data, model, positions=max(blocks))
        for block in blocks:
            for name, options, why in cases(on_gpu):
                result = ({"case": name, "failed": f"skipped: {why}"} if why else
                          our_case(name, options, model, data, block, steps, out / f"{model.name}-{block}", mixed_precision))
                results.append({"model": shape_name, "block": block, **result})
                print(f"[gpu-bench] {shape_name}, {block}: {json.dumps(result)}", flush=True)
            result = trl_case("TRL SFTTrainer, padding_free", model, data, block, steps, out / f"{model.name}-{block}",
                              mixed_precision)
            results.append({"model": shape_name, "block": block, **result})
            print(f"[gpu-bench] {shape_name}, {block}: {json.dumps(result)}", flush=True)
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['model']} | {r['block']} | {r['case']} | {r['failed']} | | | | |")
            continue
        mfu = 6 * r["params"] * r["tokens_per_sec"] / peak
        lines.append(f"| {r['model']} | {r['block']} | {r['case']} | {r['step_time_s']:.3f} | {r['tokens_per_sec']:,.0f} "
                     f"| {mfu:.1%} | {r['peak_memory_bytes']:,} | {r['loss']:.4f} |")
    grpo_shape = "Qwen2.5-0.5B shape" if on_gpu else next(iter(SMOKE_SHAPE))
    gpus = min(2, torch.cuda.device_count()) if on_gpu else 2
    batch, generations, length, _ = GRPO_SIZES["gpu" if on_gpu else "smoke"]
    lines += ["", f"GRPO on the {grpo_shape}, {gpus} process(es) under fsdp.yaml, {steps} steps of {batch} completions "
                  f"a rank ({generations} per prompt, up to {length} tokens) of the built-in module questions, reward "
                  "exact_match; step time and "
                  "rollout_time are medians after the first step; memory: rank 0's peak", "",
              "| case | step time (s) | rollout_time (s) | peak memory (bytes) | last reward |", "| --- | --- | --- | --- | --- |"]
    prompts = grpo_prompts(out)
    for name, why in grpo_cases(on_gpu):
        result = ({"case": name, "failed": f"skipped: {why}"} if why else
                  grpo_case(name, out / grpo_shape.replace(" ", "-"), prompts, gpus, steps, out / "grpo", mixed_precision,
                            "gpu" if on_gpu else "smoke"))
        results.append({"model": grpo_shape, **result})
        print(f"[gpu-bench] GRPO: {json.dumps(result)}", flush=True)
        if "failed" in result:
            lines.append(f"| {name} | {result['failed']} | | | |")
            continue
        rollout = "-" if result["rollout_time"] is None else f"{result['rollout_time']:.3f}"
        lines.append(f"| {name} | {result['step_time_s']:.3f} | {rollout} | {result['peak_memory_bytes']:,} | "
                     f"{result['reward']:.3f} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table)
    print(f"[gpu-bench] {time.perf_counter() - start:.0f} s; written under {out}")


if __name__ == "__main__":
    main()
