"""What the training loop, `finetune evaluate` and the summary ask of a task:
its data and model, its loss, its evaluation (which owns its metric) and the
unit its throughput is counted in. One subclass per task, registered in
finetune/tasks/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from finetune import models
from finetune.backends.base import Backend
from finetune.config import TrainConfig
from finetune.errors import UsageError
from finetune.peft import peft_for
from finetune.signals import NoSignal, zero_gradient
from finetune.tasks import REGISTRY, TaskEntry, task_for_config

if TYPE_CHECKING:
    import evaluate
    from transformers import ProcessorMixin

    from finetune.data.mixture import RowStream

    from finetune.shard_loading import OwnShards

METRICS_DIR = Path(__file__).resolve().parent.parent / "metrics_modules"


@dataclass
class TaskData:
    train: Dataset | None                       # None when the training rows are streamed
    validation: Dataset
    tokenizer: PreTrainedTokenizerBase | None  # saved with the model (text only)
    description: str                            # "1437 train / 360 validation images of 28x28"
    collate: Callable | None = None             # batches rows of different lengths (None: the default collate)
    eval_collate: Callable | None = None        # the held-out rows' batches, where they differ (None: collate's)
    data_format: str | None = None              # text, chat, instruction, prompt_completion or mixture (text tasks)
    stream: "RowStream | None" = None           # --streaming: this rank's training rows
    source_names: list[str] | None = None       # what the rows' per-source counts count (mixtures, streams)
    processor: "ProcessorMixin | None" = None   # a vision-language model's: its tokenizer and image processor

    @property
    def saved_with_model(self) -> "PreTrainedTokenizerBase | ProcessorMixin | None":
        """What is saved next to the weights, for the model to be used as trained."""
        return self.processor or self.tokenizer


@dataclass
class Scored:
    """What `finetune evaluate` scores."""
    rows: Dataset                # blocks, packed or padded examples, or images
    collate: Callable | None
    documents: int               # documents, examples or images before blocking


@dataclass
class LossSum:
    """A micro-batch's loss before normalisation. The loop divides the sum over
    the whole global batch (every micro-batch, every rank) by the number of
    targets in it (`Task.targets`), so ragged batches weigh every target the same."""
    total: torch.Tensor   # sum of the per-target losses
    units: torch.Tensor   # what throughput counts: real tokens, or samples
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # `Task.step_metrics`, summed over the targets


class Task:
    name: str
    metric_name: str                                # the key of its score in every evaluation
    throughput_key: str                             # metrics.jsonl's name for units per second
    batch_size_options = "--per_device_batch_size"  # what shrinks one batch, for the too-little-data error
    step_metrics: tuple[str, ...] = ()              # logged with each step, as means over its targets

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.model_source = cfg.model  # where --model is read from (a GGUF file's converted dir)
        self._metric: "evaluate.EvaluationModule | None" = None
        self.peft = peft_for(cfg)  # --peft: what trains, and how the model is saved
        self.own_shards: "OwnShards | None" = None  # set when each rank reads its shards after `prepare`

    @property
    def entry(self) -> TaskEntry:
        return REGISTRY[self.name]

    def targets(self, batch: dict) -> int:
        """The loss terms of a micro-batch (tokens with a label, or samples),
        known before its forward."""
        raise NotImplementedError

    def build(self, accelerator: Accelerator, backend: Backend, run_dir: Path) -> tuple[PreTrainedModel, TaskData]:
        """The model and the data, checked before the run writes anything; the
        backend decides whether every rank reads the weights."""
        raise NotImplementedError

    def prepared(self, accelerator: Accelerator, backend: Backend, model: torch.nn.Module) -> None:
        """After `prepare`: lays out what the task keeps beside the trained model."""

    @property
    def rows_per_batch(self) -> int:
        """Rows of the data in one micro-batch on one rank."""
        return self.cfg.per_device_batch_size

    def training_batches(self, batches):
        """What the loop trains on, made from the data's batches (EpochBatches
        or StreamBatches): those themselves, or what an objective makes of them."""
        return batches

    def step_means(self, sums: dict[str, float], count: float) -> dict[str, float]:
        """A step's `step_metrics` from their sums over the global batch and its number of targets."""
        return {name: value / max(count, 1) for name, value in sums.items()}

    def no_signal_checks(self) -> list[NoSignal]:
        """What says, step after step, that the run trains without learning (see signals.py)."""
        return [zero_gradient()]

    def frozen_reference(self) -> str | None:
        """The model a frozen copy the run compares with is read from (its
        checkpoints fingerprint it as they do the data); None without one."""
        return None

    def summary_facts(self) -> dict[str, Any]:
        """What summary.json says of the task beyond the shared keys."""
        return {}

    def held_out(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> "Scored":
        """The validation split built exactly as training builds it, for `finetune evaluate`."""
        raise NotImplementedError

    def loss(self, model, batch: dict) -> LossSum:
        raise NotImplementedError

    def evaluate(self, model, loader, accelerator: Accelerator) -> dict[str, Any]:
        """`eval_loss`, the metric under `metric_name`, and what else the metric reports."""
        raise NotImplementedError

    def metric(self, accelerator: Accelerator) -> "evaluate.EvaluationModule":
        """The task's `evaluate` module, shipped in the package (no Hub needed)."""
        if self._metric is None:
            import evaluate  # seconds to import: only runs that evaluate pay for it

            # evaluate copies the module into its cache on load: one rank at a time.
            with accelerator.main_process_first():
                self._metric = evaluate.load(str(METRICS_DIR / self.metric_name), keep_in_memory=True)
        return self._metric

    def configured(self, config):
        """--model's HF config as this task builds its model (a reward model's one-score head)."""
        return config

    def pretrained_model(self, weights_here: bool = True) -> PreTrainedModel:
        """`--model` as a Hub id or a local HF model dir, refused when it is a
        model for another task; without its weights unless `weights_here`."""
        cfg, presets = self.cfg, ", ".join(self.entry.presets)
        config = models.load_config(self.model_source, cfg.trust_remote_code, presets)
        other = task_for_config(config)
        if other is not None and not self.entry.builds(config):
            raise UsageError(f"--model {cfg.model} is for --task {other.name}, not {self.name}; "
                             f"pass --task {other.name}, or a model for --task {self.name}")
        config = self.configured(config)
        dtype = getattr(torch, cfg.model_dtype)
        if not weights_here:
            return models.placeholder_model(config, self.entry.auto(), dtype, cfg.trust_remote_code)
        return models.load_pretrained(self.model_source, self.entry.auto(), config, cfg.trust_remote_code, presets,
                                      dtype=dtype)
