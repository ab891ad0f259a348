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
from finetune.models.gguf import converted_dir, is_gguf
from finetune.tasks import task_for_config


def load_model_dir(model_dir: str):
    """(task entry, model, tokenizer or None) of a dir written by finetune, or of a GGUF file."""
    if is_gguf(model_dir):
        model_dir = str(converted_dir(model_dir))
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
def generate_text(model_dir: str, prompt: str, max_new_tokens: int = 40, chat: bool = False, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int = 0) -> str:
    """Greedy decoding unless `temperature` > 0. With `chat`, the prompt is a
    user turn rendered with the model's chat template and only the answer is
    returned; otherwise the prompt and its continuation."""
    task, model, tokenizer = load_model_dir(model_dir)
    if not task.generative:
        raise UsageError(f"{model_dir} holds an {task.name} model, which does not generate text; use `finetune evaluate`")
    if chat:
        if not tokenizer.chat_template:
            raise UsageError(f"the tokenizer in {model_dir} has no chat template; drop --chat, or train with "
                             "--chat_template FILE")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    torch.manual_seed(seed)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                         **sampling)
    return tokenizer.decode(out[0, ids.size(1):] if chat else out[0], skip_special_tokens=True).strip()


def evaluate_model_dir(model_dir: str, split: str, options: dict) -> dict:
    """The task's metric on a split built exactly as training builds it:
    `options` are the train options that choose and shape the data (the same
    seed and validation_split give the same held-out samples)."""
    entry, model, tokenizer = load_model_dir(model_dir)
    cfg = TrainConfig(task=entry.name, **options)
    task = entry.load_class()(cfg)
    accelerator = Accelerator()
    rows, collate = task.held_out(model, tokenizer, split)
    model, loader = accelerator.prepare(model, DataLoader(rows, batch_size=cfg.per_device_batch_size, collate_fn=collate))
    return task.evaluate(model, loader, accelerator)
