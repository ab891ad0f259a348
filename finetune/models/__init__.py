"""Models: named presets built from a config (tiny GPT-2 shapes, the lectures'
CNN), or any HF model by id or dir.

Nothing here knows about training, sharding or devices.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification, GPT2Config,
                          GPT2LMHeadModel, PretrainedConfig, PreTrainedModel)

from finetune.errors import UsageError
from finetune.models.cnn import LectureCNN, LectureCNNConfig

# GPT-2 shapes. Dropout is off, as in nanoGPT's from-scratch runs, so that the
# same seed gives the same losses on any number of processes.
GPT2_PRESETS: dict[str, dict] = {
    "tiny-gpt2": dict(n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=2048),
    "small-gpt2": dict(n_layer=4, n_head=4, n_embd=128, n_positions=256, vocab_size=4096),
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257),
}
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
CNN_PRESETS = {"lecture-cnn": {}}

# What each task trains, as HF Auto classes.
AUTO_CLASSES = {"causal-lm": AutoModelForCausalLM, "image-classification": AutoModelForImageClassification}
PRESET_TASKS = {**{name: "causal-lm" for name in GPT2_PRESETS}, **{name: "image-classification" for name in CNN_PRESETS}}


def is_preset(name: str) -> bool:
    return name in PRESET_TASKS


def preset_vocab_size(name: str) -> int:
    return GPT2_PRESETS[name]["vocab_size"]


def build_gpt2_preset(name: str, bos_token_id: int, eos_token_id: int) -> PreTrainedModel:
    config = GPT2Config(**GPT2_PRESETS[name], **NO_DROPOUT, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return GPT2LMHeadModel(config)


def build_cnn_preset(name: str) -> PreTrainedModel:
    return LectureCNN(LectureCNNConfig(**CNN_PRESETS[name]))


def task_of_config(config: PretrainedConfig) -> str | None:
    for task, auto in AUTO_CLASSES.items():
        if type(config) in auto._model_mapping:
            return task
    return None


def check_task(model: str, task: str) -> None:
    """A preset serves one task; say which before anything is loaded."""
    if is_preset(model) and PRESET_TASKS[model] != task:
        fitting = [name for name, t in PRESET_TASKS.items() if t == task]
        raise UsageError(f"--model {model} is for --task {PRESET_TASKS[model]}, not {task}; "
                         f"pass --task {PRESET_TASKS[model]}, or a model for --task {task} ({', '.join(fitting)})")


def from_config(config: PretrainedConfig) -> PreTrainedModel:
    """An untrained model of the architecture a config describes (use under
    `torch.device("meta")` to inspect shapes without memory)."""
    task = task_of_config(config)
    if task is None:
        raise UsageError(f"{type(config).__name__} is neither a causal LM nor an image classifier this tool trains")
    return AUTO_CLASSES[task].from_config(config)


def load_pretrained(name_or_path: str, task: str, trust_remote_code: bool = False) -> PreTrainedModel:
    """`from_pretrained` on a Hub id or a local HF model dir, with errors that say what to do."""
    path = Path(name_or_path)
    presets = ", ".join(name for name, t in PRESET_TASKS.items() if t == task)
    if path.exists() and not (path / "config.json").is_file():
        raise UsageError(f"--model {name_or_path} is not a model directory (no config.json); "
                         f"pass a dir written by save_pretrained, a Hub id, or a preset ({presets})")
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"could not load --model {name_or_path} ({first_line}); pass a local HF model dir, "
                         f"a reachable Hub id, or a preset ({presets})") from None
    if task_of_config(config) not in (task, None):
        raise UsageError(f"--model {name_or_path} is for --task {task_of_config(config)}, not {task}; "
                         f"pass --task {task_of_config(config)}, or a model for --task {task}")
    try:
        return AUTO_CLASSES[task].from_pretrained(name_or_path, config=config, trust_remote_code=trust_remote_code,
                                                  dtype=torch.float32)
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"could not load --model {name_or_path} ({first_line}); pass a local HF model dir, "
                         f"a reachable Hub id, or a preset ({presets})") from None
