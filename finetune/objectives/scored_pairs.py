"""The reward model's Task (reward_model.py): preference pairs as pairs.py
reads and stacks them, scored by the model's one-score head instead of by
their log-probs. The model is --model's body under transformers' sequence
classification head (num_labels 1, a new head when --model is a causal LM),
pooled at each sequence's last token that is not padding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel

from finetune.backends.base import Backend
from finetune.data.chat import pad_id
from finetune.objectives.pairs import PreferenceLM
from finetune.objectives.preference_loss import PairLosses
from finetune.signals import NoSignal
from finetune.tasks.base import TaskData
from finetune.tasks.causal_lm import CausalLM, model_config, model_inputs


class RewardModel(PreferenceLM):
    name = "sequence-classification"
    metric_name = "eval_accuracy"

    def configured(self, config):
        """One score, and the architecture saved with the model (so that exports and loaders find the head)."""
        config.num_labels = 1
        config.architectures = list(self.entry.model_class_names(config)[:1])
        return config

    def no_signal_checks(self) -> list[NoSignal]:
        return CausalLM.no_signal_checks(self)

    def build(self, accelerator: Accelerator, backend: Backend, run_dir: Path) -> tuple[PreTrainedModel, TaskData]:
        model, data = super().build(accelerator, backend, run_dir)
        # The head pools at the last token that is not padding, as the collator pads.
        model_config(model).pad_token_id = pad_id(data.tokenizer)
        return model, data

    def summary_facts(self) -> dict[str, Any]:
        return {}  # no reference, and no sample: a reward model does not generate

    def _pair_losses(self, model, batch: dict) -> PairLosses:
        scores = model(**model_inputs(model, batch)).logits.squeeze(-1).float()
        pairs = len(scores) // 2
        margin = batch.get("margin", torch.zeros(pairs)).to(scores)
        losses, terms = self.objective.pair_rewards_losses(self.cfg, scores[:pairs], scores[pairs:], margin)
        return PairLosses(losses, terms)
