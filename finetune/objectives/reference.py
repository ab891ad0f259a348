"""The frozen reference an objective compares the policy with (DPO's, and
GRPO's KL term): the base with the adapters off when adapters train (no
second copy), or a frozen model laid out as the trained one is (sharded under
FSDP2), with no gradients and no optimizer state. Dropout is off in both."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from finetune import models
from finetune.backends.base import Backend, shard_report
from finetune.errors import UsageError
from finetune.objectives import REGISTRY as OBJECTIVES
from finetune.objectives.base import Objective


def without_dropout(model: torch.nn.Module) -> None:
    """Every dropout off: the modules' and the attention's own probability."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


class WithReference:
    """Mixed into a causal-LM Task that trains an objective of its own, which
    may compare with a reference (`Objective.holds_reference`)."""
    reference: torch.nn.Module | None = None  # a frozen copy (full fine-tuning)
    reference_params_per_rank: list[int] = []
    accelerator: Accelerator | None = None

    @property
    def objective(self) -> Objective:
        return OBJECTIVES[self.cfg.objective]

    @property
    def needs_reference(self) -> bool:
        return self.objective.holds_reference(self.cfg)

    def frozen_reference(self) -> str | None:
        """With every parameter trained, the frozen copy is of --reference_model
        or --model (under adapters: the base, adapters off)."""
        if self.needs_reference and not self.peft.saves_adapters:
            return self.cfg.reference_model or self.cfg.model
        return None

    def check_reference_fits(self, backend: Backend) -> None:
        if self.frozen_reference() is not None and backend.frozen_model_refusal:
            raise UsageError(f"--method {self.cfg.objective} with every parameter trained needs a frozen reference "
                             f"model: {backend.frozen_model_refusal}, or {self.peft.without_a_reference_copy}")

    def reference_model(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> PreTrainedModel:
        """--reference_model, or the weights the run starts from (a preset's are
        the seed's, rebuilt). Whole on every rank until `lay_out_reference`."""
        cfg = self.cfg
        if not cfg.reference_model:
            reference = self.base_model(tokenizer)
        else:
            config = models.load_config(cfg.reference_model, cfg.trust_remote_code, "", option="--reference_model")
            reference = models.load_pretrained(cfg.reference_model, self.entry.auto(), config, cfg.trust_remote_code,
                                               "", dtype=getattr(torch, cfg.model_dtype), option="--reference_model")
            tokens = reference.config.get_text_config().vocab_size  # a vision-language model's: its language model's
            if tokens != vocab_size:
                raise UsageError(f"--reference_model {cfg.reference_model} has {tokens} tokens "
                                 f"and --model {cfg.model} {vocab_size}; the reference must score the same tokens: "
                                 "pass a model made with the policy's tokenizer")
        without_dropout(reference)
        return reference

    def lay_out_reference(self, accelerator: Accelerator, backend: Backend) -> None:
        if self.reference is not None:
            self.reference = backend.prepare_frozen(accelerator, self.reference)
            self.reference_params_per_rank = shard_report(self.reference, accelerator).local_params_per_rank

    def with_reference(self, model, score: Callable):
        """`score(model)` of the reference, without gradients."""
        with torch.no_grad():
            if self.reference is None:  # the base under the adapters
                inner = getattr(model, "module", model)  # DDP's wrapper runs no forward without gradients
                with self.peft.adapters_off(inner):
                    return score(inner)
            with self.accelerator.autocast() if self.accelerator else nullcontext():
                return score(self.reference)

    def reference_facts(self, precomputed: str = "") -> dict:
        """Which reference the run compared with, and its parameters on each rank while training."""
        if not self.needs_reference:
            reference = None
        else:
            reference = ("the base, adapters off" if self.peft.saves_adapters
                         else self.cfg.reference_model or self.cfg.model)
            if precomputed:
                reference = f"log-probs precomputed by {reference}, {precomputed}"
        return {"reference": reference, "reference_params_per_rank": self.reference_params_per_rank or None}
