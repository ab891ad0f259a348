"""Using an exported model dir in one process: generate text, measure perplexity."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.data.text import load_raw_text, tokenize_and_group
from finetune.errors import UsageError
from finetune.metrics import evaluate_perplexity, load_metric


def load_model_dir(model_dir: str):
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    except (OSError, ValueError) as e:
        raise UsageError(f"{model_dir} is not a usable model dir ({str(e).strip().splitlines()[0]}); "
                         "pass the output of `finetune export` or a run's final/ dir") from None
    return tokenizer, model


@torch.no_grad()
def generate_text(model_dir: str, prompt: str, max_new_tokens: int = 40, seed: int = 0) -> str:
    tokenizer, model = load_model_dir(model_dir)
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(seed)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                         pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def evaluate_model_dir(model_dir: str, dataset: str, text_column: str = "text", split: str = "validation",
                       block_size: int = 128, batch_size: int = 8, validation_split: float = 0.05,
                       seed: int = 42) -> dict[str, float]:
    """Perplexity on a split built exactly as training builds it (same seed, same
    validation_split: the same held-out documents)."""
    tokenizer, model = load_model_dir(model_dir)
    blocks = tokenize_and_group(load_raw_text(dataset, text_column, validation_split, seed), tokenizer, block_size)
    accelerator = Accelerator()
    model, loader = accelerator.prepare(model, DataLoader(blocks[split], batch_size=batch_size))
    return evaluate_perplexity(model, loader, accelerator, load_metric("perplexity", accelerator))
