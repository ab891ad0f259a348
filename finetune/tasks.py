"""What differs between training a causal LM and an image classifier: the data,
the model, the loss and the evaluation. The loop in train.py is the same for
both and asks the task for these four things.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from finetune import models
from finetune.config import TrainConfig
from finetune.data.images import check_labels, load_images, pixel_values
from finetune.data.text import load_raw_text, text_iterator, tokenize_and_group
from finetune.data.tokenizer import train_bpe_tokenizer
from finetune.errors import UsageError
from finetune.metrics import evaluate_accuracy, evaluate_perplexity, next_token_loss


@dataclass
class TaskData:
    model: PreTrainedModel
    train: Dataset
    validation: Dataset
    tokenizer: PreTrainedTokenizerBase | None  # saved with the model (text only)
    description: str                            # "1437 train / 360 validation images of 28x28"


class Task:
    """The four things the loop asks of a task; `units_per_sample` turns
    samples/s into the throughput unit (tokens for text)."""

    name: str
    metric_name: str
    throughput_key: str
    batch_size_options = "--per_device_batch_size"  # what shrinks one batch, for the too-little-data error

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def units_per_sample(self) -> int:
        return 1

    def build(self, accelerator: Accelerator, run_dir: Path) -> TaskData:
        raise NotImplementedError

    def loss(self, model, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model, loader, accelerator: Accelerator, metric) -> dict[str, Any]:
        raise NotImplementedError


class CausalLM(Task):
    name = "causal-lm"
    metric_name = "perplexity"
    throughput_key = "tokens_per_sec"
    batch_size_options = "--per_device_batch_size/--block_size"

    def units_per_sample(self) -> int:
        return self.cfg.block_size

    def build(self, accelerator: Accelerator, run_dir: Path) -> TaskData:
        """Data and model, checked before the run writes anything but its
        tokenizer. The main process goes first and fills the datasets cache."""
        cfg = self.cfg
        with accelerator.main_process_first():
            raw = load_raw_text(cfg.dataset, cfg.text_column, cfg.validation_split, cfg.seed)
        if accelerator.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
        tokenizer, model = self._tokenizer_and_model(raw["train"], accelerator, run_dir)
        with accelerator.main_process_first():
            blocks = tokenize_and_group(raw, tokenizer, cfg.block_size)
        return TaskData(model, blocks["train"], blocks["validation"], tokenizer,
                        f"{len(blocks['train'])} train / {len(blocks['validation'])} validation blocks of {cfg.block_size}")

    def _tokenizer_and_model(self, raw_train: Dataset, accelerator: Accelerator, run_dir: Path):
        """A preset trains its own tokenizer on the training text (once, on the
        main process, saved with the run); anything else brings its tokenizer."""
        cfg = self.cfg
        if models.is_preset(cfg.model):
            tokenizer_dir = run_dir / "tokenizer"
            if accelerator.is_main_process and not (tokenizer_dir / "tokenizer.json").is_file():
                tok = train_bpe_tokenizer(text_iterator(raw_train), models.preset_vocab_size(cfg.model))
                tok.save_pretrained(tokenizer_dir)
            accelerator.wait_for_everyone()
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            set_seed(cfg.seed)  # every rank initialises the same weights before sharding
            model = models.build_gpt2_preset(cfg.model, tokenizer.bos_token_id, tokenizer.eos_token_id)
        else:
            model = models.load_pretrained(cfg.model, self.name, cfg.trust_remote_code)
            try:
                tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
            except (OSError, ValueError) as e:
                raise UsageError(f"--model {cfg.model} has no usable tokenizer ({str(e).splitlines()[0]}); "
                                 "save one next to the model with tokenizer.save_pretrained") from None
        if tokenizer.eos_token_id is None:
            raise UsageError(f"the tokenizer of --model {cfg.model} has no end-of-text token; set eos_token and save it again")
        if len(tokenizer) > model.config.vocab_size:
            raise UsageError(f"the tokenizer has {len(tokenizer)} tokens but --model {cfg.model} only "
                             f"{model.config.vocab_size}; use the tokenizer the model was trained with")
        if cfg.block_size > model.config.max_position_embeddings:
            raise UsageError(f"--block_size {cfg.block_size} is longer than the model's "
                             f"{model.config.max_position_embeddings} positions; lower --block_size")
        return tokenizer, model

    def loss(self, model, batch: dict) -> torch.Tensor:
        # No KV cache: a training forward never reuses it.
        return next_token_loss(model(input_ids=batch["input_ids"], use_cache=False).logits, batch["input_ids"])

    def evaluate(self, model, loader, accelerator: Accelerator, metric) -> dict[str, Any]:
        return evaluate_perplexity(model, loader, accelerator, metric, self.cfg.max_eval_batches)


class ImageClassification(Task):
    name = "image-classification"
    metric_name = "accuracy"
    throughput_key = "samples_per_sec"

    def build(self, accelerator: Accelerator, run_dir: Path) -> TaskData:
        cfg = self.cfg
        if models.is_preset(cfg.model):
            set_seed(cfg.seed)  # every rank initialises the same weights before sharding
            model = models.build_cnn_preset(cfg.model)
        else:
            model = models.load_pretrained(cfg.model, self.name, cfg.trust_remote_code)
        image_size = getattr(model.config, "image_size", None)
        if getattr(model.config, "num_channels", 1) != 1 or not isinstance(image_size, int):
            raise UsageError(f"--model {cfg.model} does not take square grayscale images; use lecture-cnn or a "
                             "model saved from it")
        with accelerator.main_process_first():
            splits, names = load_images(cfg.dataset, cfg.image_column, cfg.label_column, image_size,
                                        cfg.validation_split, cfg.seed)
        check_labels(splits, model.config.num_labels, cfg.dataset)
        if names and len(names) == model.config.num_labels:  # exported with the model: config.id2label
            model.config.id2label = dict(enumerate(names))
            model.config.label2id = {name: i for i, name in enumerate(names)}
        if accelerator.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
        return TaskData(model, splits["train"], splits["validation"], None,
                        f"{len(splits['train'])} train / {len(splits['validation'])} validation images of "
                        f"{image_size}x{image_size}")

    def loss(self, model, batch: dict) -> torch.Tensor:
        # Cross-entropy on logits, in fp32 whatever the compute dtype.
        return F.cross_entropy(model(pixel_values(batch)).logits.float(), batch["label"])

    def evaluate(self, model, loader, accelerator: Accelerator, metric) -> dict[str, Any]:
        return evaluate_accuracy(model, loader, accelerator, metric, pixel_values, self.cfg.max_eval_batches)


TASK_CLASSES = {task.name: task for task in (CausalLM, ImageClassification)}


def build_task(cfg: TrainConfig) -> Task:
    return TASK_CLASSES[cfg.task](cfg)

