"""Using an exported model dir in one process: generate text, measure
perplexity (causal LMs) or accuracy (image classifiers)."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoTokenizer

from finetune import models
from finetune.data.images import check_labels, load_images, pixel_values
from finetune.data.text import load_raw_text, tokenize_and_group
from finetune.errors import UsageError
from finetune.metrics import evaluate_accuracy, evaluate_perplexity, load_metric


def load_model_dir(model_dir: str):
    """(task, model, tokenizer or None) of a dir written by finetune."""
    try:
        config = AutoConfig.from_pretrained(model_dir)
        task = models.task_of_config(config)
        if task is None:
            raise ValueError(f"{type(config).__name__} is neither a causal LM nor an image classifier")
        model = models.AUTO_CLASSES[task].from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir) if task == "causal-lm" else None
    except (OSError, ValueError) as e:
        raise UsageError(f"{model_dir} is not a usable model dir ({str(e).strip().splitlines()[0]}); "
                         "pass the output of `finetune export` or a run's final/") from None
    return task, model, tokenizer


@torch.no_grad()
def generate_text(model_dir: str, prompt: str, max_new_tokens: int = 40, seed: int = 0) -> str:
    task, model, tokenizer = load_model_dir(model_dir)
    if task != "causal-lm":
        raise UsageError(f"{model_dir} holds an {task} model, which does not generate text; use `finetune evaluate`")
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(seed)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                         pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def evaluate_model_dir(model_dir: str, dataset: str, split: str = "validation", batch_size: int = 8,
                       validation_split: float = 0.05, seed: int = 42, text_column: str = "text",
                       block_size: int = 128, image_column: str = "image", label_column: str = "label") -> dict:
    """Perplexity or accuracy on a split built exactly as training builds it
    (same seed, same validation_split: the same held-out samples)."""
    task, model, tokenizer = load_model_dir(model_dir)
    accelerator = Accelerator()
    if task == "causal-lm":
        blocks = tokenize_and_group(load_raw_text(dataset, text_column, validation_split, seed), tokenizer, block_size)
        model, loader = accelerator.prepare(model, DataLoader(blocks[split], batch_size=batch_size))
        return evaluate_perplexity(model, loader, accelerator, load_metric("perplexity", accelerator))
    images, _ = load_images(dataset, image_column, label_column, model.config.image_size, validation_split, seed)
    check_labels(images, model.config.num_labels, dataset)
    model, loader = accelerator.prepare(model, DataLoader(images[split], batch_size=batch_size))
    return evaluate_accuracy(model, loader, accelerator, load_metric("accuracy", accelerator), pixel_values)
