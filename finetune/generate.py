"""Text generation from an exported model dir, in one process."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@torch.no_grad()
def generate_text(model_dir: str, prompt: str, max_new_tokens: int = 40, seed: int = 0) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(seed)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                         pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)
