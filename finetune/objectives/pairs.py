"""Preference tuning of a causal LM on pairs (dpo.py, simpo.py, ...: the
objectives of base.py's PairObjective): the causal-LM task's model and
tokenizer, preference pairs for data (data/preference.py), and the
objective's loss on each pair's completion log-probs (preference_loss.py).

Chosen and rejected go through one forward, stacked. The reference DPO
compares with is reference.py's. Dropout is off, as in TRL: at step 1 the
policy and the reference then agree, and the DPO loss is ln 2.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from datasets import DatasetDict
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from finetune.backends.base import Backend
from finetune.collectives import broadcast_from_main
from finetune.data.builtin import cache_root
from finetune.data.chat import load_chat_template, pad_id
from finetune.data.preference import PairCollator, build_pair_splits
from finetune.errors import UsageError
from finetune.objectives.preference_loss import PairLogps, PairLosses
from finetune.report import plain_logs
from finetune.signals import NoSignal
from finetune.objectives.reference import WithReference, without_dropout
from finetune.tasks.base import LossSum, Scored, TaskData
from finetune.tasks.causal_lm import CausalLM, model_config
from finetune.tasks.lm_loss import IGNORE, completion_logits, full_logits_nll, next_token_targets


class PreferenceLM(WithReference, CausalLM):
    metric_name = "eval_rewards/accuracies"
    batch_size_options = "--per_device_batch_size"
    watches_routers = False  # its own loss; expert load and the load-balancing loss are SFT's

    def __init__(self, cfg):
        super().__init__(cfg)
        self.step_metrics = self.objective.metrics  # logged with each step, as means over its pairs
        self.splits: list = []                                  # the pair splits, numbered across (`pair`)
        self.reference_table: torch.Tensor | None = None        # [pairs, 2] precomputed reference log-probs
        self.cached_table: Path | None = None                    # where they are cached
        self.sample_prompt: str | list | None = None             # a held-out prompt (text or messages)

    def no_signal_checks(self) -> list[NoSignal]:
        return [*super().no_signal_checks(), NoSignal(
            "rewards/accuracies", lambda v: v >= 1.0, 5,
            "every pair is ranked right from the start, so the pairs teach the model little; check that "
            "the rejected answers are not trivially told apart (empty, cut short, one fixed text, always shorter) "
            "and that the reference is the model you start from", from_first_step=True)]

    def targets(self, batch: dict) -> int:
        return len(batch["input_ids"]) // 2  # pairs

    def build(self, accelerator: Accelerator, backend: Backend, run_dir: Path) -> tuple[PreTrainedModel, TaskData]:
        copy_needed = self.frozen_reference() is not None
        self.check_reference_fits(backend)
        self.accelerator = accelerator
        model, data = super().build(accelerator, backend, run_dir)
        without_dropout(model)
        self.splits = [data.train, data.validation]
        if self.cfg.precompute_reference:
            self.cached_table, self.reference_table = cached_reference(self, accelerator, model)
        if copy_needed and self.reference_table is None:
            self.reference = self.reference_model(data.tokenizer, model_config(model).get_text_config().vocab_size)
        return model, data

    def prepared(self, accelerator: Accelerator, backend: Backend, model: torch.nn.Module) -> None:
        self.lay_out_reference(accelerator, backend)
        if self.cfg.precompute_reference and self.reference_table is None:
            self.reference_table = precompute_reference(self, accelerator, model)
            # Scored with forwards alone: under adapters the reference is the policy, whose root
            # unit FSDP2 keeps gathered after a forward, into training where it must be sharded.
            backend.after_evaluation(model)
        if self.reference_table is not None:  # training holds no reference
            self.reference, self.reference_params_per_rank = None, []
            gc.collect()

    def summary_facts(self) -> dict[str, Any]:
        return {**self.reference_facts(str(self.cached_table) if self.reference_table is not None else ""),
                "sample_prompt": self.sample_prompt}

    # --- data -------------------------------------------------------------------------------------

    def _raw_data(self, data_format: str = "", scoring: bool = False) -> tuple[DatasetDict, str]:
        # The objective's own format, whatever the columns: the embedded default's rows in it, or its own error.
        return super()._raw_data(self.objective.data_format)

    def _splits(self, raw: DatasetDict, data_format: str, tokenizer: PreTrainedTokenizerBase) -> tuple[DatasetDict, str]:
        cfg = self.cfg
        first = raw["train"][0] if len(raw["train"]) else {}
        if "validation" in raw and len(raw["validation"]):  # what the run's closing sample answers
            held_out = raw["validation"][0]
            self.sample_prompt = held_out.get("prompt") or (held_out["chosen"][:-1] or None
                                                            if isinstance(held_out["chosen"], list) else None)
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
        if self.reference_table is not None:
            known = self.reference_table[batch["pair"].cpu()].to(policy.chosen)
            reference = PairLogps(known[:, 0], known[:, 1], policy.chosen_tokens, policy.rejected_tokens)
        elif self.needs_reference:
            reference = self._reference_logps(model, batch)
        return self.objective.pair_losses(self.cfg, policy, reference)

    def _reference_logps(self, model, batch: dict) -> PairLogps:
        return self.with_reference(model, lambda scorer: self._pair_logps(scorer, batch, sequence_nll=False))

    def _pair_logps(self, model, batch: dict, sequence_nll: bool = True) -> PairLogps:
        """Summed log-probs of the completions (the labelled tokens) of the
        batch's chosen rows (its first half) and rejected rows, and where the
        objective reads it the NLL of each whole chosen sequence, prompt
        included. From the logits (the chunked loss gives no per-row gradient),
        of the completions' positions alone unless the whole sequences are read."""
        targets = next_token_targets(batch["labels"])
        whole_sequence = sequence_nll and self.objective.reads_chosen_sequence
        if whole_sequence:
            logits = model(**self.inputs(model, batch)).logits
        else:
            logits, targets = completion_logits(model, self.inputs(model, batch), targets)
        logps = -full_logits_nll(logits, targets).sum(dim=-1)
        counts = (targets != IGNORE).sum(dim=-1)
        pairs = len(logps) // 2
        out = PairLogps(logps[:pairs], logps[pairs:], counts[:pairs], counts[pairs:])
        if whole_sequence:
            whole = next_token_targets(batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE))[:pairs]
            out.chosen_sequence_nll = full_logits_nll(logits[:pairs], whole).sum(dim=-1)
            out.chosen_sequence_tokens = (whole != IGNORE).sum(dim=-1)
        return out

    @torch.no_grad()
    def evaluate(self, model, loader, accelerator: Accelerator) -> dict[str, Any]:
        """Means over every held-out pair (`gather_for_metrics` drops the pairs
        the distributed sampler repeated)."""
        was_training = model.training
        model.eval()
        metrics = self.step_metrics
        sums = torch.zeros(1 + len(metrics), dtype=torch.float64)
        pairs = 0
        for i, batch in enumerate(loader):
            if self.cfg.max_eval_batches and i >= self.cfg.max_eval_batches:
                break
            out = self._pair_losses(model, batch)
            values = accelerator.gather_for_metrics(torch.stack([out.losses, *(out.metrics[m] for m in metrics)], 1))
            sums += values.double().sum(dim=0).cpu()
            pairs += len(values)
        model.train(was_training)
        means = (sums / max(pairs, 1)).tolist()
        return {"eval_loss": means[0], **{f"eval_{name}": value for name, value in zip(metrics, means[1:])}}



def cached_reference(task: PreferenceLM, accelerator: Accelerator, model) -> tuple[Path, torch.Tensor | None]:
    """Where these pairs' reference log-probs are cached, and them when they are."""
    from safetensors import safe_open

    from finetune.model_dir import is_own_file

    key = _cache_key(task, accelerator, model) if accelerator.is_main_process else None
    key = broadcast_from_main(key) if accelerator.num_processes > 1 else key  # one verdict for every rank
    path = cache_root() / "reference_logps" / f"{key}.safetensors"
    pairs = sum(len(split) for split in task.splits)
    if is_own_file(path):  # not a link, which could lead to any file of scores
        try:
            with safe_open(str(path), "pt") as f:  # the file read once: its key and its scores
                recorded, table = (f.metadata() or {}).get("key"), f.get_tensor("logps")
        except Exception:  # noqa: BLE001  (a damaged cache file is scored again)
            recorded, table = None, None
        # Its own key inside, and log-probs (finite, <= 0) of as many pairs: else it is scored again.
        if (recorded == key and table is not None and table.shape == (pairs, 2) and bool(torch.isfinite(table).all())
                and bool((table <= 0).all())):
            accelerator.print(f"reference log-probs of {pairs} pairs read from {path}")
            return path, table
    return path, None


def precompute_reference(task: PreferenceLM, accelerator: Accelerator, model: torch.nn.Module) -> torch.Tensor:
    """[pairs, 2]: the reference's summed log-probs of each pair's chosen and
    rejected completion, by pair number. Every rank scores every world_size-th
    pair (a forward is collective: the same number of batches each), the scores
    are gathered, and the main process caches them."""
    from safetensors.torch import save_file

    pairs = [pair for split in task.splits for pair in split]
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(pairs), world))
    per_rank = -(-len(pairs) // world)
    mine += [mine[-1] if mine else 0] * (per_rank - len(mine))  # padding: as many forwards on every rank
    size = task.cfg.per_device_eval_batch_size or task.cfg.per_device_batch_size
    collate = PairCollator(0)
    scores = []
    was_training = model.training
    model.eval()
    bar_shown = accelerator.is_main_process and not plain_logs(task.cfg.log_format)  # none in a redirected log
    with tqdm(total=len(pairs), desc="reference log-probs", disable=not bar_shown) as bar:
        for start in range(0, per_rank, size):
            batch = {k: v.to(accelerator.device) for k, v in collate([pairs[i] for i in mine[start:start + size]]).items()}
            with torch.no_grad():
                logps = task._reference_logps(model, batch)
            scores.append(torch.stack([logps.chosen, logps.rejected], dim=1).float())
            bar.update(min(size, per_rank - start) * world)
    model.train(was_training)
    gathered = accelerator.gather(torch.cat(scores)).cpu()  # rank-major: rank r's j-th is pair r + j * world
    table = torch.empty(len(pairs), 2)
    for r in range(world):
        for j, i in enumerate(range(r, len(pairs), world)):
            table[i] = gathered[r * per_rank + j]
    if accelerator.is_main_process:
        cached = task.cached_table
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        save_file({"logps": table.contiguous()}, str(tmp), metadata={"key": cached.stem})
        os.replace(tmp, cached)
        accelerator.print(f"reference log-probs of {len(pairs)} pairs computed once, cached in {cached}")
    return table


def _cache_key(task: PreferenceLM, accelerator: Accelerator, model) -> str:
    """What the scores depend on: the pairs' tokens and labels, the reference's
    weights (the recorded fingerprint of an adapted base, or the reference's
    files, or a preset's weights on the main process), and the precision."""
    from finetune.model_dir import weights_fingerprint

    cfg = task.cfg
    if task.peft.saves_adapters:
        reference = task.peft.base_record["fingerprint"]
    elif cfg.reference_model and not Path(cfg.reference_model).exists():
        reference = f"hub:{cfg.reference_model}"
    else:
        reference = weights_fingerprint(cfg.reference_model or task.model_source, model)
    # A QLoRA base scores in 4 bits (the layers it adapts) what a LoRA base of the same files, or the same
    # model fully trained, scores in full precision: those share their scores, QLoRA's are its own.
    four_bit = cfg.lora_target_modules if task.peft.four_bit_bytes_per_weight else None
    digest = hashlib.sha256(json.dumps({"reference": reference, "dtype": cfg.model_dtype, "four_bit": four_bit,
                                        "mixed_precision": accelerator.mixed_precision}).encode())
    for split in task.splits:
        for pair in split:
            digest.update(json.dumps([pair[f"{side}_{part}"] for side in ("chosen", "rejected")
                                      for part in ("input_ids", "labels")]).encode())
    return digest.hexdigest()[:32]
