"""TRL's GRPOTrainer (transformers' generate, or vLLM colocated) on a model dir and a
file of prompts with an `answer` column, rewarded by finetune's built-in
exact_match (the same function our run calls), for `scripts/bench.py --suite
grpo` (under `accelerate launch`, as our runs are). Each rank writes its step
times (between step ends, generation included), its peak resident set, the
reward and completion length of every step, and its layout to OUT/rank-N.json.

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 \\
        scripts/bench_trl_grpo.py MODEL_DIR PROMPTS.jsonl OUT BATCH GENERATIONS COMPLETION_LENGTH STEPS \\
        LEARNING_RATE MIXED_PRECISION [ENGINE]

ENGINE: `generate` (the default: transformers', on CPU or GPU) or `vllm`
(TRL's use_vllm with vllm_mode="colocate" at 0.3 of each GPU: scripts/gpu_bench.py).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bench import step_timer, write_rank_result  # scripts/ is this script's dir, first on sys.path
    from finetune.objectives.rewards import exact_match

    import torch

    model_dir, prompts, out, batch, generations, length, steps, learning_rate, mixed_precision = sys.argv[1:10]
    engine = sys.argv[10] if len(sys.argv) > 10 else "generate"
    vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3) if engine == "vllm" else {}
    out = Path(out)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    timer = step_timer()
    config = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=int(batch),
                        num_generations=int(generations), max_completion_length=int(length), max_steps=int(steps),
                        learning_rate=float(learning_rate), lr_scheduler_type="constant", warmup_steps=0,
                        loss_type="dapo", beta=0.0, temperature=1.0, bf16=mixed_precision == "bf16",
                        use_cpu=not torch.cuda.is_available(), **vllm,
                        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=42)
    trainer = GRPOTrainer(model=model, reward_funcs=[exact_match], args=config,
                          train_dataset=load_dataset("json", data_files=prompts)["train"],
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    logged = [row for row in trainer.state.log_history if "reward" in row]
    write_rank_result(trainer, timer, out, rewards=[row["reward"] for row in logged],
                      completion_lengths=[row["completions/mean_length"] for row in logged])


if __name__ == "__main__":
    main()
