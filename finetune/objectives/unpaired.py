"""KTO's Task (kto.py): unpaired completions labelled desirable or not
(data/unpaired.py), each scored by the policy and a frozen reference (pairs.py's,
whose model, reference and build it shares), and each micro-batch's mismatched
rows scored without gradient for the KL estimate."""

from __future__ import annotations

from typing import Any, Callable

import torch
from accelerate import Accelerator
from datasets import DatasetDict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from finetune.data.chat import load_chat_template, pad_id
from finetune.data.unpaired import UnpairedCollator, build_unpaired_splits
from finetune.errors import UsageError
from finetune.objectives.pairs import PreferenceLM
from finetune.signals import NoSignal
from finetune.tasks.base import LossSum, Scored
from finetune.tasks.causal_lm import CausalLM, model_inputs
from finetune.tasks.lm_loss import completion_logits, full_logits_nll, next_token_targets

ROW_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


class UnpairedLM(PreferenceLM):
    metric_name = "eval_rewards/margins"

    def __init__(self, cfg):
        super().__init__(cfg)
        # What the loop sums over the global batch; step_means turns them into TRL's per-class means.
        self.step_metrics = ("kl", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected",
                             "desirable", "undesirable")

    def no_signal_checks(self) -> list[NoSignal]:
        return CausalLM.no_signal_checks(self)  # no pairs: nothing is ranked from the start

    def targets(self, batch: dict) -> int:
        return len(batch["label"])  # completions

    # --- data -------------------------------------------------------------------------------------

    def _splits(self, raw: DatasetDict, data_format: str,
                tokenizer: PreTrainedTokenizerBase) -> tuple[DatasetDict, str]:
        cfg = self.cfg
        first = raw["train"][0] if len(raw["train"]) else {}
        if "validation" in raw and len(raw["validation"]):  # what the run's closing sample answers
            self.sample_prompt = raw["validation"][0].get("prompt")
        load_chat_template(tokenizer, cfg.chat_template,
                           "chat" if isinstance(first.get("completion"), list) else "prompt_completion", cfg.model)
        return build_unpaired_splits(raw, tokenizer, cfg.block_size, cfg.max_prompt_length, cfg.long_examples,
                                     cfg.preprocessing_num_workers)

    def _collate(self, data_format: str, tokenizer: PreTrainedTokenizerBase) -> Callable | None:
        return UnpairedCollator(pad_id(tokenizer), self.cfg.block_size)

    def held_out(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> Scored:
        raise UsageError("finetune evaluate scores perplexity or accuracy; a KTO run's rewards are in its "
                         "summary.json (first_eval / last_eval) and metrics.jsonl")

    # --- loss -------------------------------------------------------------------------------------

    def loss(self, model, batch: dict) -> LossSum:
        losses, terms = self._losses(model, batch)
        return LossSum(total=losses.sum(), units=batch["attention_mask"][:len(losses)].sum(),
                       metrics={name: values.sum() for name, values in terms.items()})

    def _losses(self, model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = len(batch["label"])
        matched = {key: batch[key][:rows] for key in ROW_KEYS}
        mismatched = {key: batch[key][rows:] for key in ROW_KEYS}
        policy = completion_logps(model, matched)
        uses_kl = self.objective.uses_kl(self.cfg)
        # The reference scores the rows and the mismatched rows in one forward (one gather of a sharded copy).
        scored = self.with_reference(model, lambda scorer: completion_logps(
            scorer, {key: batch[key] for key in ROW_KEYS} if uses_kl else matched))
        reference, reference_kl = scored[:rows], scored[rows:] if uses_kl else None
        kl = torch.zeros((), device=policy.device)
        if reference_kl is not None:
            with torch.no_grad():
                kl = (completion_logps(model, mismatched) - reference_kl).mean()
            if self.accelerator is not None and self.accelerator.num_processes > 1:
                kl = self.accelerator.reduce(kl, reduction="mean")  # every rank's micro-batch, as TRL gathers
            kl = kl.clamp(min=0)
        return self.objective.unpaired_losses(self.cfg, policy, reference, batch["label"].to(policy.device), kl)

    def step_means(self, sums: dict[str, float], count: float) -> dict[str, float]:
        return self.objective.means(dict(sums), count)

    @torch.no_grad()
    def evaluate(self, model, loader, accelerator: Accelerator) -> dict[str, Any]:
        """Each class's means over every held-out completion (`gather_for_metrics`
        drops the rows the distributed sampler repeated)."""
        was_training = model.training
        model.eval()
        names = self.step_metrics
        sums = torch.zeros(1 + len(names), dtype=torch.float64)
        for i, batch in enumerate(loader):
            if self.cfg.max_eval_batches and i >= self.cfg.max_eval_batches:
                break
            losses, terms = self._losses(model, batch)
            rows = torch.stack([losses, *(terms[name] for name in names)], 1)
            sums += accelerator.gather_for_metrics(rows).double().sum(dim=0).cpu()
        model.train(was_training)
        totals = dict(zip(names, sums[1:].tolist()))
        count = totals["desirable"] + totals["undesirable"]
        means = self.objective.means(totals, count)
        return {"eval_loss": float(sums[0]) / max(count, 1), **{f"eval_{name}": v for name, v in means.items()}}


def completion_logps(model, rows: dict) -> torch.Tensor:
    """[N] summed log-probs of each row's completion (its labelled tokens)."""
    logits, targets = completion_logits(model, model_inputs(model, rows), next_token_targets(rows["labels"]))
    return -full_logits_nll(logits, targets).sum(dim=-1)

