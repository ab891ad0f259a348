"""Causal language modelling: text cut into token blocks, next-token
cross-entropy, perplexity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from finetune import models
from finetune.data.text import load_raw_text, text_iterator, tokenize_and_group
from finetune.data.tokenizer import train_bpe_tokenizer
from finetune.errors import UsageError
from finetune.presets import GPT2_PRESETS
from finetune.tasks.base import Task, TaskData


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """Targets for every position: the next token, ignored (-100) at the last.
    Shifting the targets instead of the logits spares a copy of the [B, T,
    vocab] logits, the largest tensor of the step."""
    return F.pad(input_ids[:, 1:], (0, 1), value=-100)


def next_token_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token NLL [B, T-1] of predicting input_ids[:, t+1] from position t,
    in fp32 whatever the compute dtype (bf16 logits would quantise the loss)."""
    targets = next_token_targets(input_ids)
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    return nll.view(targets.shape)[:, :-1]


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean of next_token_nll, reduced inside cross_entropy."""
    return F.cross_entropy(logits.float().flatten(0, 1), next_token_targets(input_ids).flatten(), ignore_index=-100)


class CausalLM(Task):
    name = "causal-lm"
    metric_name = "perplexity"
    throughput_key = "tokens_per_sec"
    batch_size_options = "--per_device_batch_size/--block_size"

    def units_per_sample(self) -> int:
        return self.cfg.block_size

    def build(self, accelerator: Accelerator, run_dir: Path) -> tuple[PreTrainedModel, TaskData]:
        """The main process goes first and fills the datasets cache; the run dir
        gets nothing but a preset's tokenizer before every check has passed."""
        cfg = self.cfg
        with accelerator.main_process_first():
            raw = load_raw_text(cfg.dataset, cfg.text_column, cfg.validation_split, cfg.seed)
        if accelerator.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
        tokenizer, model = self._tokenizer_and_model(raw["train"], accelerator, run_dir)
        with accelerator.main_process_first():
            blocks = tokenize_and_group(raw, tokenizer, cfg.block_size)
        return model, TaskData(blocks["train"], blocks["validation"], tokenizer,
                               f"{len(blocks['train'])} train / {len(blocks['validation'])} validation blocks "
                               f"of {cfg.block_size}")

    def held_out(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, split: str) -> Dataset:
        cfg = self.cfg
        self._check_block_size(model)
        raw = load_raw_text(cfg.dataset, cfg.text_column, cfg.validation_split, cfg.seed)
        return tokenize_and_group(DatasetDict({split: raw[split]}), tokenizer, cfg.block_size)[split]

    def _tokenizer_and_model(self, raw_train: Dataset, accelerator: Accelerator, run_dir: Path):
        """A preset trains its own tokenizer on the training text (once, on the
        main process, saved with the run); anything else brings its tokenizer."""
        cfg = self.cfg
        if cfg.model in GPT2_PRESETS:
            tokenizer_dir = run_dir / "tokenizer"
            if accelerator.is_main_process and not (tokenizer_dir / "tokenizer.json").is_file():
                tok = train_bpe_tokenizer(text_iterator(raw_train), GPT2_PRESETS[cfg.model]["vocab_size"])
                tok.save_pretrained(tokenizer_dir)
            accelerator.wait_for_everyone()
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
            set_seed(cfg.seed)  # every rank initialises the same weights before sharding
            model = models.build_gpt2(GPT2_PRESETS[cfg.model], tokenizer.bos_token_id, tokenizer.eos_token_id)
        else:
            model = self.pretrained_model()
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
        self._check_block_size(model)
        return tokenizer, model

    def _check_block_size(self, model: PreTrainedModel) -> None:
        if self.cfg.block_size > model.config.max_position_embeddings:
            raise UsageError(f"--block_size {self.cfg.block_size} is longer than the model's "
                             f"{model.config.max_position_embeddings} positions; lower --block_size")

    def loss(self, model, batch: dict) -> torch.Tensor:
        # No KV cache: a training forward never reuses it.
        return next_token_loss(model(input_ids=batch["input_ids"], use_cache=False).logits, batch["input_ids"])

    @torch.no_grad()
    def evaluate(self, model, loader, accelerator: Accelerator) -> dict[str, Any]:
        """Every rank runs the same number of batches (FSDP forwards are collective);
        `gather_for_metrics` drops the samples the distributed sampler repeated."""
        metric = self.metric(accelerator)
        was_training = model.training
        model.eval()
        for i, batch in enumerate(loader):
            if self.cfg.max_eval_batches and i >= self.cfg.max_eval_batches:
                break
            ids = batch["input_ids"]
            nll = next_token_nll(model(input_ids=ids, use_cache=False).logits, ids)
            counts = torch.full((nll.size(0),), nll.size(1), dtype=torch.long, device=nll.device)
            nll_sum, counts = accelerator.gather_for_metrics((nll.sum(dim=1), counts))
            metric.add_batch(nll_sum=nll_sum.double().cpu().tolist(), num_tokens=counts.cpu().tolist())
        model.train(was_training)
        return metric.compute()
