"""Causal LMs: named presets built from a config, or any HF model by id or dir.

Nothing here knows about training, sharding or devices.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedModel

from finetune.errors import UsageError

# GPT-2 shapes. Dropout is off, as in nanoGPT's from-scratch runs, so that the
# same seed gives the same losses on any number of processes.
GPT2_PRESETS: dict[str, dict] = {
    "tiny-gpt2": dict(n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=2048),
    "small-gpt2": dict(n_layer=4, n_head=4, n_embd=128, n_positions=256, vocab_size=4096),
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257),
}
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def is_preset(name: str) -> bool:
    return name in GPT2_PRESETS


def preset_vocab_size(name: str) -> int:
    return GPT2_PRESETS[name]["vocab_size"]


def build_preset(name: str, bos_token_id: int, eos_token_id: int) -> PreTrainedModel:
    config = GPT2Config(**GPT2_PRESETS[name], **NO_DROPOUT, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return GPT2LMHeadModel(config)


def load_pretrained(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedModel:
    """`from_pretrained` on a Hub id or a local HF model dir, with errors that say what to do."""
    path = Path(name_or_path)
    if path.exists() and not (path / "config.json").is_file():
        raise UsageError(f"--model {name_or_path} is not a model directory (no config.json); "
                         f"pass a dir written by save_pretrained, a Hub id, or a preset ({', '.join(GPT2_PRESETS)})")
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        return AutoModelForCausalLM.from_pretrained(name_or_path, config=config, trust_remote_code=trust_remote_code,
                                                    dtype="float32")
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"could not load --model {name_or_path} ({first_line}); pass a local HF model dir, "
                         f"a reachable Hub id, or a preset ({', '.join(GPT2_PRESETS)})") from None

