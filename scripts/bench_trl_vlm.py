"""TRL's SFTTrainer on a vision-language model dir and a JSON Lines file of
image conversations (TRL's messages + images format, absolute image paths),
for `scripts/bench.py --suite vlm` (run under `accelerate launch`, as our runs
are). Each rank writes its step times (between step ends, data loading and
image decoding included, as our loop logs them) and its peak resident set to OUT/rank-N.json.

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 \\
        scripts/bench_trl_vlm.py MODEL_DIR ROWS.jsonl OUT BATCH STEPS MIXED_PRECISION
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    from datasets import load_dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    from bench import step_timer, write_rank_result  # scripts/ is this script's dir, first on sys.path

    model_dir, rows, out, batch, steps, mixed_precision = sys.argv[1:]
    out = Path(out)
    timer = step_timer()
    config = SFTConfig(output_dir=str(out / "trl"), per_device_train_batch_size=int(batch), max_steps=int(steps),
                       learning_rate=1e-4, max_length=None, bf16=mixed_precision == "bf16", use_cpu=True, report_to=[],
                       save_strategy="no", logging_steps=int(steps), disable_tqdm=True, dataloader_drop_last=True,
                       seed=42)
    trainer = SFTTrainer(model=AutoModelForImageTextToText.from_pretrained(model_dir), args=config,
                         train_dataset=load_dataset("json", data_files=rows)["train"],
                         processing_class=AutoProcessor.from_pretrained(model_dir), callbacks=[timer])
    trainer.train()
    write_rank_result(trainer, timer, out)


if __name__ == "__main__":
    main()
