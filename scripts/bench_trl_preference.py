"""TRL's DPOTrainer, KTOTrainer or RewardTrainer on a model dir and a file of
its data, for `scripts/bench.py --suite dpo|kto|reward` (run under
`accelerate launch`, as our runs are). Each rank writes its step times (between
step ends, data loading included, as our loop logs them) and its peak resident
set to OUT/rank-N.json.

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 \\
        scripts/bench_trl_preference.py dpo|kto|reward MODEL_DIR DATA.jsonl OUT BATCH STEPS BLOCK_SIZE MIXED_PRECISION
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    import trl

    from bench import step_timer, write_rank_result  # scripts/ is this script's dir, first on sys.path

    objective, model_dir, data, out, batch, steps, block_size, mixed_precision = sys.argv[1:]
    out = Path(out)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if objective == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    # The defaults each tool starts from (TRL's), the same on both sides of the table.
    own = {"dpo": dict(learning_rate=1e-6, beta=0.1, loss_type="sigmoid"),
           "kto": dict(learning_rate=1e-6, beta=0.1),
           "reward": dict(learning_rate=1e-4)}[objective]
    config_class, trainer_class = {"dpo": (trl.DPOConfig, trl.DPOTrainer), "kto": (trl.KTOConfig, trl.KTOTrainer),
                                   "reward": (trl.RewardConfig, trl.RewardTrainer)}[objective]
    timer = step_timer()
    # FSDP comes from the launch. On a CPU-only machine Accelerate turns it into
    # DDP (MULTI_CPU), whatever the Trainer is given: the table says which layout ran.
    config = config_class(output_dir=str(out / "trl"), per_device_train_batch_size=int(batch), max_steps=int(steps),
                          max_length=int(block_size), bf16=mixed_precision == "bf16", use_cpu=True, report_to=[],
                          save_strategy="no", logging_steps=int(steps), disable_tqdm=True, dataloader_drop_last=True,
                          seed=42, **own)
    trainer = trainer_class(model=model, args=config, train_dataset=load_dataset("json", data_files=data)["train"],
                            processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    write_rank_result(trainer, timer, out)


if __name__ == "__main__":
    main()
