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


def evaluate_model_dir(model_dir: str, options: dict, held_out: bool = False) -> dict:
    """The task's metric on exactly the split `options["dataset_split"]` names,
    else the data's own validation or test split, else all of it. With
    `held_out`, the part training held out instead (the same validation_split
    and seed: the same samples). `options` are the train options that shape the
    data; the result also says how much was scored."""
    entry, model, tokenizer = load_model_dir(model_dir)
    options = dict(options)
    if not held_out:  # score the split itself: nothing is split off it
        options.update(validation_split=0.0, eval_split=options.get("dataset_split", ""))
    cfg = TrainConfig(task=entry.name, **options)
    task = entry.load_class()(cfg)
    accelerator = Accelerator()
    scored = task.held_out(model, tokenizer)
    loader = DataLoader(scored.rows, batch_size=cfg.per_device_batch_size, collate_fn=scored.collate)
    model, loader = accelerator.prepare(model, loader)
    return {**task.evaluate(model, loader, accelerator), "documents": scored.documents, "rows": len(scored.rows),
            "batches": len(loader)}
