"""Using an exported model dir in one process: generate text, or score it
(perplexity, accuracy) with its task's own evaluation."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader, Subset
from transformers import AutoConfig, AutoTokenizer

import finetune.models.cnn  # noqa: F401  (registers the lecture CNN with the Auto classes)
from finetune.config import DATA_OPTIONS, TrainConfig
from finetune.data.formats import FORMATS
from finetune.objectives import REGISTRY as OBJECTIVES, recorded_objective
from finetune.data.templates import check_chat_template
from finetune.errors import UsageError, missing_or_odd
from finetune.model_dir import read_run_data
from finetune.models import check_model_files
from finetune.models.gguf import converted_dir, is_gguf
from finetune.tasks import task_for_config


def load_model_dir(model_dir: str):
    """(task entry, model, tokenizer or None) of a dir written by finetune, or of a GGUF file."""
    if is_gguf(model_dir):
        model_dir = str(converted_dir(model_dir))
    elif not Path(model_dir).exists() and (model_dir.startswith((".", "/", "~")) or model_dir.count("/") > 1):
        raise UsageError(f"{model_dir} {missing_or_odd(model_dir)}; pass the output of `finetune export` or a run's "
                         "final/")
    elif Path(model_dir).exists() and not Path(model_dir).is_dir():
        raise UsageError(f"{model_dir} {missing_or_odd(model_dir)}, not a model dir or a .gguf file; pass the output "
                         "of `finetune export` or a run's final/")
    if Path(model_dir).is_dir():
        check_model_files(Path(model_dir), str(model_dir))
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
        task = task_for_config(config)
        if task is None:
            raise ValueError(f"{type(config).__name__} is neither a causal LM nor an image classifier")
        model = task.auto().from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=False).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False) if task.has_tokenizer else None
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: weights that do not fit the config
        raise UsageError(f"{model_dir} is not a usable model dir ({str(e).strip().splitlines()[0][:200]}); "
                         "pass the output of `finetune export` or a run's final/") from None
    return task, model, tokenizer


@torch.no_grad()
def generate_text(model_dir: str, prompt: str | list[dict], max_new_tokens: int = 40, chat: bool | None = False,
                  temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, images: list[str] = ()) -> str:
    """Greedy decoding unless `temperature` > 0. With `chat`, the prompt (a
    user turn's text, or messages) is rendered with the model's chat template
    and only the answer is returned; otherwise the prompt and its
    continuation. `chat=None`: chat when the model has a chat template.
    `images`: image files the user turn shows first (a vision-language model's)."""
    task, model, tokenizer = load_model_dir(model_dir)
    if not task.generative:
        raise UsageError(f"{model_dir} holds an {task.name} model, which does not generate text; use `finetune evaluate`")
    inputs = {}  # beside the ids: an image prompt's pixels and masks
    if chat is None:
        chat = bool(tokenizer.chat_template) or isinstance(prompt, list) or bool(images)
    if images:
        chat = True
        ids, inputs = _image_prompt(model_dir, task, prompt, images)
    elif chat:
        if not tokenizer.chat_template:
            raise UsageError(f"the tokenizer in {model_dir} has no chat template; drop --chat, or train with "
                             "--chat_template FILE")
        check_chat_template(tokenizer, f"the chat template of {model_dir}")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    torch.manual_seed(seed)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    positions = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    try:
        out = model.generate(**{"attention_mask": torch.ones_like(ids), **inputs, "input_ids": ids},
                             max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                             else tokenizer.eos_token_id, **sampling)
    except IndexError:  # a learned position embedding looked up past its table
        raise UsageError(f"the prompt's {ids.size(1)} tokens and --max_new_tokens {max_new_tokens} pass the "
                         f"{positions} positions of {model_dir}; pass --max_new_tokens "
                         f"{max(1, (positions or 0) - ids.size(1))} or less") from None
    return tokenizer.decode(out[0, ids.size(1):] if chat else out[0], skip_special_tokens=True).strip()


def _image_prompt(model_dir: str, task, prompt: str, images: list[str]) -> tuple[torch.Tensor, dict]:
    """A user turn showing `images` before `prompt`, through the model's
    processor: its input ids, and the pixels and masks the model takes."""
    from transformers import AutoProcessor

    from finetune.data.vision import open_image

    if not task.has_processor:
        raise UsageError(f"{model_dir} holds a model that reads text alone; --image needs a vision-language model "
                         "(trained with --task image-text-to-text)")
    pictures = []
    for name in images:
        path = Path(name).expanduser()
        if not path.is_file():
            raise UsageError(f"--image {name} {missing_or_odd(name)}; pass an image file")
        pictures.append(open_image(path.name, path.resolve().parent, f"--image {name}"))
    try:
        processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=False)
    except (OSError, ValueError, ImportError) as e:
        raise UsageError(f"{model_dir} has no usable processor ({str(e).strip().splitlines()[0][:160]}); pass a "
                         "model dir written with its processor (a run's final/, or `finetune export`)") from None
    parts = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)
    out = processor(text=[text], images=[pictures], add_special_tokens=False, return_tensors="pt")
    ids = out.pop("input_ids")
    return ids, dict(out)


# Recorded data options that only make sense for the run's own dataset.
OF_THE_RUNS_DATA = ("dataset_config", "dataset_split", "eval_split", "text_column", "image_column", "label_column",
                    "max_eval_samples", "dataset_weights", "mixture_stop", "streaming")


def evaluate_model_dir(model_dir: str, given: dict, score_split: str = "", held_out: bool = False,
                       batch_size: int = 8) -> tuple[dict, str]:
    """The task's metric, and a note of what was scored. Data options not
    `given` are those of the run that wrote the model (recorded next to it),
    else train's defaults. Without a `dataset` given, a recorded model is
    scored on what its run evaluated on (its held-out part); otherwise on
    exactly `score_split`, else the data's own validation or test split, else
    all of it, or with `held_out` on the part a run with these options held out."""
    recorded = read_run_data(model_dir)
    objective = recorded_objective(recorded)
    held = OBJECTIVES[objective].data_format if objective in OBJECTIVES else None
    if held and "dataset" not in given:
        raise UsageError(f"{model_dir} was trained with --method {objective}, whose held-out data "
                         f"({FORMATS[held].words}) has no text to score perplexity on; its held-out scores are in its "
                         "run's summary.json (first_eval, last_eval), or pass --dataset with text to score the model on")
    entry, model, tokenizer = load_model_dir(model_dir)
    if "dataset" in given:  # other data: keep only the run's options that do not name its data's parts
        recorded = {k: v for k, v in recorded.items() if k not in OF_THE_RUNS_DATA
                    and not (k == "data_format" and v in FORMATS and not FORMATS[v].sft)}  # an objective's: the new data's own
    options = {**recorded, **given}
    what = "the run's held-out data" if "dataset" in recorded and "dataset" not in given and not score_split else ""
    if not (held_out or what):  # score the split itself: nothing is split off it
        options.update(validation_split=0.0, dataset_split="", eval_split=score_split)
    block_size = ""
    if entry.generative:
        if "block_size" in given:
            block_size = f"block size {options['block_size']}"
        elif "block_size" in recorded:
            block_size = f"block size {options['block_size']} (the run's)"
        else:
            context = getattr(model.config, "max_position_embeddings", None) or 1024
            options["block_size"] = min(context, 1024)
            block_size = f"block size {options['block_size']} (the model's context length, at most 1024)"
    cfg = TrainConfig(task=entry.name, per_device_batch_size=batch_size,
                      **({"model": str(model_dir)} if entry.has_processor else {}),  # its processor makes the batches
                      **{k: v for k, v in options.items() if k in DATA_OPTIONS})
    task = entry.load_class()(cfg)
    from accelerate import Accelerator  # here: generate needs none of Accelerate (1.3 s of imports)

    accelerator = Accelerator()
    scored = task.held_out(model, tokenizer)
    rows = scored.rows
    if what and recorded.get("max_eval_rows"):  # the run's evaluations scored only the first rows
        rows = Subset(rows, range(min(recorded["max_eval_rows"], len(rows))))
        what += f" (the first {len(rows):,} rows, as its evaluations scored)"
    loader = DataLoader(rows, batch_size=cfg.per_device_batch_size, collate_fn=scored.collate)
    model, loader = accelerator.prepare(model, loader)
    result = {**task.evaluate(model, loader, accelerator), "documents": scored.documents, "rows": len(rows),
              "batches": len(loader)}
    return result, "; ".join(note for note in (what or f"--dataset {cfg.dataset}", block_size) if note)
