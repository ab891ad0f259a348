"""Config-only model dirs of the mixtures of experts users plan for, with the
hyperparameters their model cards publish (the Hub is not needed: the
planner builds the model on the meta device from config.json alone).

    python scripts/moe_configs.py OUT_DIR
    finetune estimate-memory --model OUT_DIR/Qwen3-30B-A3B --num_processes 8 --device_memory_gb 80
"""

from __future__ import annotations

import sys
from pathlib import Path

PUBLISHED = {
    "Qwen3-30B-A3B": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=40960, tie_word_embeddings=False)),
    "gpt-oss-20b": ("gpt_oss", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 150000.0})),
    "Mixtral-8x7B": ("mixtral", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        rope_theta=1e6, tie_word_embeddings=False)),
}


def write(out: Path) -> list[Path]:
    from transformers import AutoConfig

    dirs = []
    for name, (model_type, values) in PUBLISHED.items():
        AutoConfig.for_model(model_type, **values).save_pretrained(out / name)
        dirs.append(out / name)
    return dirs


if __name__ == "__main__":
    for path in write(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/moe-configs")):
        print(path)
