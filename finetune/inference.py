"""Using an exported model dir in one process: generate text, or score it
(perplexity, accuracy) with its task's own evaluation."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoTokenizer

import finetune.models  # noqa: F401  (registers the lecture CNN's config with AutoConfig)
from finetune.config import TrainConfig
from finetune.errors import UsageError
from finetune.tasks import task_for_config


def load_model_dir(model_dir: str):
    """(task entry, model, tokenizer or None) of a dir written by finetune."""
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
        task = task_for_config(config)
        if task is None:
            raise ValueError(f"{type(config).__name__} is neither a causal LM nor an image classifier")
        model = task.auto().from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=False).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False) if task.has_tokenizer else None
    except (OSError, ValueError) as e:
        raise UsageError(f"{model_dir} is not a usable model dir ({str(e).strip().splitlines()[0]}); "
                         "pass the output of `finetune export` or a run's final/") from None
    return task, model, tokenizer


@torch.no_grad()
def generate_text(model_dir: str, prompt: str, max_new_tokens: int = 40, seed: int = 0) -> str:
    task, model, tokenizer = load_model_dir(model_dir)
    if not task.generative:
        raise UsageError(f"{model_dir} holds an {task.name} model, which does not generate text; use `finetune evaluate`")
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(seed)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                         pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def evaluate_model_dir(model_dir: str, dataset: str, split: str = "validation", batch_size: int = 8,
                       validation_split: float = 0.05, seed: int = 42, text_column: str = "text",
                       block_size: int = 128, image_column: str = "image", label_column: str = "label") -> dict:
    """The task's metric on a split built exactly as training builds it (same
    seed, same validation_split: the same held-out samples)."""
    entry, model, tokenizer = load_model_dir(model_dir)
    cfg = TrainConfig(task=entry.name, dataset=dataset, validation_split=validation_split, seed=seed,
                      text_column=text_column, block_size=block_size, image_column=image_column,
                      label_column=label_column, per_device_batch_size=batch_size)
    task = entry.load_class()(cfg)
    accelerator = Accelerator()
    model, loader = accelerator.prepare(model, DataLoader(task.held_out(model, tokenizer, split), batch_size=batch_size))
    return task.evaluate(model, loader, accelerator)
