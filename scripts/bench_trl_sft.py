"""TRL's SFTTrainer with `padding_free` packing on a model dir and a chat
jsonl, one process, for `scripts/gpu_bench.py` (the same model, data, block
size, batch, steps and precision as our cases). Writes its step time, tokens/s,
peak memory and last loss to RESULT.json.

    python scripts/bench_trl_sft.py MODEL_DIR CHATS.jsonl OUT BLOCK_SIZE STEPS MIXED_PRECISION RESULT.json
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
from pathlib import Path


def main() -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from bench import step_timer  # scripts/ is this script's dir, first on sys.path

    model_dir, data, out, block_size, steps, mixed_precision, result = sys.argv[1:]
    on_gpu = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # TRL's padding-free packing keeps examples apart by position ids: flash-attention or flex attention on a GPU.
    attention = "flex_attention" if on_gpu else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention)
    timer = step_timer()
    config = SFTConfig(output_dir=str(Path(out)), per_device_train_batch_size=1, max_steps=int(steps),
                       learning_rate=1e-4, max_length=int(block_size), packing=True, padding_free=True,
                       bf16=mixed_precision == "bf16", use_cpu=not on_gpu, report_to=[], save_strategy="no",
                       logging_steps=1, disable_tqdm=True, seed=42, assistant_only_loss=False)
    trainer = SFTTrainer(model=model, args=config, train_dataset=load_dataset("json", data_files=data)["train"],
                         processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    times = timer.times[1:] or timer.times
    step = statistics.median(times)
    tokens = [b - a for a, b in zip([0] + [r.get("num_tokens", 0) for r in logs], [r.get("num_tokens", 0) for r in logs])]
    peak = (torch.cuda.max_memory_allocated() if on_gpu
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    Path(result).write_text(json.dumps({
        "step_time_s": step, "tokens_per_sec": statistics.median(tokens[1:] or tokens) / step,
        "peak_memory_bytes": peak, "loss": logs[-1]["loss"], "params": sum(p.numel() for p in model.parameters()),
        "layout": f"one process, {attention}"}))


if __name__ == "__main__":
    main()
