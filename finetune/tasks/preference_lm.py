"""Preference tuning of a causal LM (--method dpo or simpo): the causal-LM
task's model and tokenizer, preference pairs for data (data/preference.py),
and a loss on each pair's completion log-probs (methods/preference.py).

Chosen and rejected go through one forward, stacked. The reference DPO
compares with is the base with the adapters off under LoRA (no second copy),
or a frozen model laid out as the trained one is (sharded under FSDP2), with
no gradients and no optimizer state. Dropout is off, as in TRL: at step 1 the
policy and the reference then agree, and the DPO loss is ln 2.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from datasets import DatasetDict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from finetune import models
from finetune.backends.base import Backend, shard_report
from finetune.data.chat import load_chat_template, pad_id
from finetune.data.preference import PairCollator, build_pair_splits
from finetune.errors import UsageError
from finetune.methods.preference import METRICS, PairLogps, PairLosses, preference_loss
from finetune.tasks.base import LossSum, Scored, TaskData
from finetune.tasks.causal_lm import CausalLM, attention_inputs, model_config
from finetune.tasks.lm_loss import IGNORE, full_logits_nll, next_token_targets


def without_dropout(model: torch.nn.Module) -> None:
    """Every dropout off: the modules' and the attention's own probability."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


class PreferenceLM(CausalLM):
    metric_name = "eval_rewards/accuracies"
    batch_size_options = "--per_device_batch_size"
    step_metrics = METRICS

    def __init__(self, cfg):
        super().__init__(cfg)
        self.objective = preference_loss(cfg)
        self.reference: torch.nn.Module | None = None  # a frozen copy (full fine-tuning under DPO)
        self.reference_params_per_rank: list[int] = []
        self.accelerator: Accelerator | None = None

    def targets(self, batch: dict) -> int:
        return len(batch["input_ids"]) // 2  # pairs

    def build(self, accelerator: Accelerator, backend: Backend, run_dir: Path) -> tuple[PreTrainedModel, TaskData]:
        copy_needed = self.objective.needs_reference and not self.method.saves_adapters
        if copy_needed and backend.frozen_model_refusal:
            raise UsageError(f"--method {self.cfg.method} with every parameter trained needs a frozen reference "
                             f"model: {backend.frozen_model_refusal}")
        self.accelerator = accelerator
        model, data = super().build(accelerator, backend, run_dir)
        without_dropout(model)
        if copy_needed:
            self.reference = self._reference_model(data.tokenizer, model_config(model).vocab_size)
        return model, data

    def _reference_model(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> PreTrainedModel:
        """--reference_model, or the weights the run starts from (a preset's are
        the seed's, rebuilt). Whole on every rank until `prepared` lays it out."""
        cfg = self.cfg
        if not cfg.reference_model:
            reference = self.base_model(tokenizer)
        else:
            config = models.load_config(cfg.reference_model, cfg.trust_remote_code, "")
            reference = models.load_pretrained(cfg.reference_model, self.entry.auto(), config, cfg.trust_remote_code,
                                               "", dtype=getattr(torch, cfg.model_dtype))
            if reference.config.vocab_size != vocab_size:
                raise UsageError(f"--reference_model {cfg.reference_model} has {reference.config.vocab_size} tokens "
                                 f"and --model {cfg.model} {vocab_size}; the reference must score the same tokens: "
                                 "pass a model made with the policy's tokenizer")
        without_dropout(reference)
        return reference

    def prepared(self, accelerator: Accelerator, backend: Backend) -> None:
        if self.reference is not None:
            self.reference = backend.prepare_frozen(accelerator, self.reference)
            self.reference_params_per_rank = shard_report(self.reference, accelerator).local_params_per_rank

    def summary_facts(self) -> dict[str, Any]:
        return {"reference": ("the base, adapters off" if self.objective.needs_reference and self.reference is None
                              else self.cfg.reference_model or self.cfg.model) if self.objective.needs_reference
                else None,
                "reference_params_per_rank": self.reference_params_per_rank or None}

    # --- data -------------------------------------------------------------------------------------

    def _raw_data(self, data_format: str = "") -> tuple[DatasetDict, str]:
        cfg = self.cfg
        # The embedded default has a set of pairs; other data must turn out to be pairs.
        raw, found = super()._raw_data("preference" if cfg.dataset == "builtin" else cfg.data_format)
        if found != "preference":
            raise UsageError(f"--method {cfg.method} trains on preference pairs (chosen and rejected columns), and "
                             f"--dataset {cfg.dataset} holds {found} data; give it chosen/rejected (and prompt) "
                             "columns, or train on it with --method sft")
        return raw, found

    def _splits(self, raw: DatasetDict, data_format: str, tokenizer: PreTrainedTokenizerBase) -> tuple[DatasetDict, str]:
        cfg = self.cfg
        first = raw["train"][0] if len(raw["train"]) else {}
        rendered_as = "chat" if isinstance(first.get("chosen"), list) else "prompt_completion"
        load_chat_template(tokenizer, cfg.chat_template, rendered_as, cfg.model)
        return build_pair_splits(raw, tokenizer, cfg.block_size, cfg.max_prompt_length, cfg.long_examples,
                                 cfg.preprocessing_num_workers)

    @staticmethod
    def _collate(data_format: str, tokenizer: PreTrainedTokenizerBase) -> Callable | None:
        return PairCollator(pad_id(tokenizer))

    def held_out(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> Scored:
        raise UsageError("finetune evaluate scores perplexity or accuracy; a preference run's rewards are in its "
                         "summary.json (first_eval / last_eval) and metrics.jsonl")

    # --- loss -------------------------------------------------------------------------------------

    def loss(self, model, batch: dict) -> LossSum:
        out = self._pair_losses(model, batch)
        tokens = batch["attention_mask"].sum()
        return LossSum(total=out.losses.sum(), units=tokens,
                       metrics={name: values.sum() for name, values in out.metrics.items()})

    def _pair_losses(self, model, batch: dict) -> PairLosses:
        policy = self._pair_logps(model, batch)
        reference = None
        if self.objective.needs_reference:
            with torch.no_grad():
                reference = self._reference_logps(model, batch)
        return self.objective(policy, reference)

    def _reference_logps(self, model, batch: dict) -> PairLogps:
        if self.reference is None:  # the base under the adapters
            inner = getattr(model, "module", model)  # DDP's wrapper runs no forward without gradients
            with self.method.adapters_off(inner):
                return self._pair_logps(inner, batch)
        with self.accelerator.autocast() if self.accelerator else nullcontext():
            return self._pair_logps(self.reference, batch)

    @staticmethod
    def _pair_logps(model, batch: dict) -> PairLogps:
        """Summed log-probs of the completions (the labelled tokens) of the
        batch's chosen rows (its first half) and rejected rows. From the full
        logits: the chunked loss gives no per-row gradient."""
        targets = next_token_targets(batch["labels"])
        inputs = {"input_ids": batch["input_ids"], "use_cache": False,
                  **attention_inputs(batch, model_config(model)._attn_implementation)}
        logps = -full_logits_nll(model(**inputs).logits, targets).sum(dim=-1)
        counts = (targets != IGNORE).sum(dim=-1)
        pairs = len(logps) // 2
        return PairLogps(logps[:pairs], logps[pairs:], counts[:pairs], counts[pairs:])

    @torch.no_grad()
    def evaluate(self, model, loader, accelerator: Accelerator) -> dict[str, Any]:
        """Means over every held-out pair (`gather_for_metrics` drops the pairs
        the distributed sampler repeated)."""
        was_training = model.training
        model.eval()
        sums = torch.zeros(1 + len(METRICS), dtype=torch.float64)
        pairs = 0
        for i, batch in enumerate(loader):
            if self.cfg.max_eval_batches and i >= self.cfg.max_eval_batches:
                break
            out = self._pair_losses(model, batch)
            values = accelerator.gather_for_metrics(torch.stack([out.losses, *(out.metrics[m] for m in METRICS)], 1))
            sums += values.double().sum(dim=0).cpu()
            pairs += len(values)
        model.train(was_training)
        means = (sums / max(pairs, 1)).tolist()
        return {"eval_loss": means[0], **{f"eval_{name}": value for name, value in zip(METRICS, means[1:])}}

