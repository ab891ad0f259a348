"""Image classification (the lectures' CNN): grayscale pixels, cross-entropy
on logits, accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from finetune import models
from finetune.data.images import check_labels, load_images, pixel_values
from finetune.backends.base import Backend
from finetune.collectives import main_process_first
from finetune.errors import UsageError
from finetune.presets import CNN_PRESETS
from finetune.tasks.base import LossSum, Scored, Task, TaskData


class ImageClassification(Task):
    name = "image-classification"
    metric_name = "accuracy"
    throughput_key = "samples_per_sec"

    def build(self, accelerator: Accelerator, backend: Backend, run_dir: Path) -> tuple[PreTrainedModel, TaskData]:
        cfg = self.cfg
        if cfg.model in CNN_PRESETS:
            set_seed(cfg.seed)  # every rank initialises the same weights before sharding
            model = models.build_cnn(CNN_PRESETS[cfg.model])
        else:
            model = self.pretrained_model()
        image_size = getattr(model.config, "image_size", None)
        if getattr(model.config, "num_channels", 1) != 1 or not isinstance(image_size, int):
            raise UsageError(f"--model {cfg.model} does not take square grayscale images; use lecture-cnn or a "
                             "model saved from it")
        splits, names = main_process_first(accelerator, lambda: self._images(model))
        if names and len(names) == model.config.num_labels:  # exported with the model: config.id2label
            model.config.id2label = dict(enumerate(names))
            model.config.label2id = {name: i for i, name in enumerate(names)}
        if accelerator.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
        return model, TaskData(splits["train"], splits["validation"], None,
                               f"{len(splits['train'])} train / {len(splits['validation'])} validation images of "
                               f"{image_size}x{image_size}")

    def held_out(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> Scored:
        images = self._images(model)[0]["validation"]
        return Scored(images, None, len(images))

    def _images(self, model: PreTrainedModel):
        cfg = self.cfg
        splits, names = load_images(cfg.dataset, cfg.image_column, cfg.label_column, model.config.image_size,
                                    cfg.validation_split, cfg.seed, config=cfg.dataset_config, split=cfg.dataset_split,
                                    eval_split=cfg.eval_split)
        check_labels(splits, model.config.num_labels, cfg.dataset)
        return splits, names

    def loss(self, model, batch: dict) -> LossSum:
        # Cross-entropy on logits, in fp32 whatever the compute dtype.
        total = F.cross_entropy(model(pixel_values(batch)).logits.float(), batch["label"], reduction="sum")
        return LossSum(total=total, units=torch.tensor(batch["label"].numel(), device=total.device))

    def targets(self, batch: dict) -> int:
        return batch["label"].numel()

    @torch.no_grad()
    def evaluate(self, model, loader, accelerator: Accelerator) -> dict[str, Any]:
        """Accuracy and mean cross-entropy over all ranks. `gather_for_metrics`
        drops the samples the distributed sampler repeated to even out the ranks,
        so every sample counts once."""
        metric = self.metric(accelerator)
        was_training = model.training
        model.eval()
        nll_sum, count = 0.0, 0
        for i, batch in enumerate(loader):
            if self.cfg.max_eval_batches and i >= self.cfg.max_eval_batches:
                break
            logits = model(pixel_values(batch)).logits.float()
            nll = F.cross_entropy(logits, batch["label"], reduction="none")
            predictions, references, nll = accelerator.gather_for_metrics((logits.argmax(dim=-1), batch["label"], nll))
            metric.add_batch(predictions=predictions.cpu().tolist(), references=references.cpu().tolist())
            nll_sum += float(nll.double().sum())
            count += nll.numel()
        model.train(was_training)
        result = metric.compute()
        return {"eval_loss": nll_sum / count, "accuracy": result["accuracy"], "num_samples": result["num_samples"]}
