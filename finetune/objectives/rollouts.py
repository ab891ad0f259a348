"""Online RL with verifiable rewards (grpo.py, rloo.py: the objectives of
base.py's RolloutObjective): the causal-LM task's model and tokenizer, prompts
for data, and the objective's loss on the policy's own samples.

Every optimizer step (every --num_iterations steps when above 1) starts with a
rollout: each rank samples --num_generations completions of each of its
prompts (engines.py: from the model as the backend lays it out, FSDP2
gathering a layer at a time, or from a whole replica), the reward functions score them, and the objective
computes the advantages over each group. The loop then trains on the
completions as on any micro-batches. Sampling is seeded from (--seed, the
rollout's number, the rank), and a checkpoint saves a rollout still in use,
so a resume draws and trains on exactly what the uninterrupted run did.

A training batch of prompts holds each prompt --num_generations times in a
row (its group). Sampling sits behind one seam, `Sampler.sample(model,
prompts, inputs, greedy) -> Sampled` (completion ids, and the engine's
log-probs of them where it computes its own; `inputs`: what else the model
reads of the prompts, a vision-language model's pixels, vision_rollouts.py),
on the generation engine the run picked
(engines.py: the policy as held, a replica, or vLLM's engine). Evaluations decode one greedy completion per held-out
prompt and report its reward (`reward` in eval rows; `eval_loss` is its negative).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from datasets import Dataset, DatasetDict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from finetune.backends.base import Backend
from finetune.data.chat import EXAMPLE_NUMBER, PadCollator, load_chat_template, pad_id, well_formed_messages
from finetune.errors import UsageError
from finetune.report import say
from finetune.signals import NoSignal
from finetune.objectives import grpo_loss
from finetune.objectives.engine_choice import choose_engine, engine_classes
from finetune.objectives.engines import AsHeld, Sampled, Sampling
from finetune.objectives.reference import WithReference, without_dropout
from finetune.objectives.rewards import RewardFunction, load_reward_functions, score
from finetune.tasks.base import LossSum, Scored, TaskData
from finetune.tasks.causal_lm import CausalLM
from finetune.tasks.lm_loss import IGNORE, completion_logits, full_logits_nll, next_token_targets
from finetune import json_text

# Summed over a step's completion tokens, logged as their means (TRL's names).
TOKEN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
FLOAT_KEYS = ("advantages", "old_logps", "reference_logps", "importance")  # a saved rollout's float tensors
COMPLETIONS_FILE = "completions.jsonl"


class PromptCollator:
    """Left-pads a batch of prompts (generation appends to their right), each
    `copies` times in a row: a rollout's group of completions of one prompt."""

    def __init__(self, pad_id: int, copies: int = 1):
        self.pad_id, self.copies = pad_id, copies

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        rows = [row for row in rows for _ in range(self.copies)]
        width = max(len(r["prompt_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["prompt_ids"])
            ids[i, width - n:] = torch.tensor(row["prompt_ids"])
            mask[i, width - n:] = 1
        return {"prompt_ids": ids, "prompt_mask": mask, "row": torch.tensor([r["row"] for r in rows])}


class Sampler:
    """Completions of left-padded prompts, from the engine (engines.py) the run
    picked, with the run's sampling settings."""

    def __init__(self, engine: AsHeld, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, temperature: float,
                 top_p: float, never: tuple[int, ...] = ()):
        self.engine = engine
        self.settings = Sampling(max_new_tokens, temperature, top_p, tokenizer.eos_token_id, pad_id(tokenizer),
                                 never=never)

    def sample(self, model, prompts: dict, inputs: dict, greedy: bool) -> Sampled:
        """`prompts`: a prompt batch (PromptCollator's); `inputs`: what else
        the model reads of it (a vision-language model's pixels)."""
        return self.engine.sample(model, prompts["prompt_ids"], prompts["prompt_mask"],
                                  replace(self.settings, greedy=greedy), inputs)


@contextmanager
def seeded(seed: int, device: torch.device):
    """Sampling from its own seed; the run's RNG streams (dropout, data order) are left as they were."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class RolloutLM(WithReference, CausalLM):
    metric_name = "reward"
    batch_size_options = "--per_device_batch_size (completions; prompts per batch: it / --num_generations)"
    step_metrics = (*TOKEN_METRICS, "completion_tokens")
    watches_routers = False  # its own loss; expert load and the load-balancing loss are SFT's

    def __init__(self, cfg):
        super().__init__(cfg)
        self.rewards: list[RewardFunction] = load_reward_functions(cfg.reward_funcs, cfg.reward_pattern,
                                                                   cfg.max_completion_length)
        self.weights = torch.tensor(cfg.reward_weights or [1.0] * len(self.rewards), dtype=torch.float32)
        self.rows: list[dict] = []          # the prompt rows of both splits, by `row` number
        self.conversational = False
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.sampler: Sampler | None = None
        self.policy: torch.nn.Module | None = None
        self.backend: Backend | None = None
        self.run_dir: Path | None = None
        self.rollout_metrics: dict[str, float] = {}  # of the rollout the step trained on
        self.warned_unscored = False  # the warning that no completion got a reward, said once
        self.training_started = time.perf_counter()  # of the step's training, after its rollout
        self.sample_prompt: str | list | None = None  # a held-out prompt (text or messages)

    @property
    def rows_per_batch(self) -> int:
        return self.cfg.per_device_batch_size // self.cfg.num_generations  # prompts; each makes a group

    def build(self, accelerator: Accelerator, backend: Backend, run_dir: Path) -> tuple[PreTrainedModel, TaskData]:
        self.check_reference_fits(backend)
        if backend.generation_refusal:
            raise UsageError(backend.generation_refusal)
        self.accelerator, self.run_dir = accelerator, run_dir
        model, data = super().build(accelerator, backend, run_dir)
        data.eval_collate = self._collate(data.data_format, data.tokenizer, copies=1)  # one greedy answer a prompt
        without_dropout(model)  # the sampling policy and the trained one are the same function
        self.tokenizer = data.tokenizer
        if self.frozen_reference() is not None:
            self.reference = self.reference_model(data.tokenizer, model.config.get_text_config().vocab_size)
        data.description += (f"; {self.cfg.num_generations} completions of up to {self.cfg.max_completion_length} "
                             f"tokens per prompt, rewarded by {', '.join(r.name for r in self.rewards)}")
        return model, data

    def prepared(self, accelerator: Accelerator, backend: Backend, model: torch.nn.Module) -> None:
        self.lay_out_reference(accelerator, backend)
        self.policy, self.backend = model, backend
        engine = choose_engine("vllm" if self.cfg.use_vllm else self.cfg.generation_engine, accelerator, backend, model,
                               self.prompts_have_images)
        say(accelerator, f"generation: {engine.name} ({engine.why})")
        self.sampler = Sampler(engine_classes()[engine.name](accelerator, backend, self.cfg), self.tokenizer,
                               self.cfg.max_completion_length, self.cfg.temperature, self.cfg.top_p,
                               self.never_sampled())

    def summary_facts(self) -> dict[str, Any]:
        return {**self.reference_facts(), "reward_funcs": [r.spec for r in self.rewards],
                "generation_engine": self.sampler.engine.name if self.sampler else "",
                "last_rollout": self.rollout_metrics,  # TRL's names, of the last step's samples
                "sample_prompt": self.sample_prompt}

    def training_batches(self, batches):
        return RolloutBatches(batches, self)

    # --- data -------------------------------------------------------------------------------------

    def _raw_data(self, data_format: str = "", scoring: bool = False) -> tuple[DatasetDict, str]:
        cfg = self.cfg
        raw, found = super()._raw_data("prompt")  # its own format, whatever the columns: its own error
        if found != "prompt":
            raise UsageError(f"--method grpo samples completions of prompts (a prompt column), and --dataset "
                             f"{cfg.dataset} holds {found} data; give it a prompt column (a string or messages)")
        return raw, found

    def _splits(self, raw: DatasetDict, data_format: str, tokenizer: PreTrainedTokenizerBase) -> tuple[DatasetDict, str]:
        cfg = self.cfg
        first = raw["train"][0] if len(raw["train"]) else {}
        self.conversational = isinstance(first.get("prompt"), list)
        if self.conversational and not (cfg.chat_template or tokenizer.chat_template):
            raise UsageError(f"--dataset {cfg.dataset} holds prompts as messages, which a chat template renders, and "
                             f"the tokenizer of --model {cfg.model} has none; pass --chat_template FILE, prompts as "
                             "strings, or a chat model")
        load_chat_template(tokenizer, cfg.chat_template, "chat" if self.conversational else "prompt_completion",
                           cfg.model)
        room = cfg.block_size - cfg.max_completion_length
        splits, counts = {}, {}
        for name, split in raw.items():
            rows, cut, dropped = [], 0, 0
            for values in split:
                ids = self._prompt_ids(values, tokenizer, f"--dataset {cfg.dataset} example {values.get(EXAMPLE_NUMBER)}")
                if len(ids) > room:
                    if cfg.long_examples == "drop":
                        dropped += 1
                        continue
                    ids, cut = ids[-room:], cut + 1  # the prompt's end leads into the completion
                columns = {k: v for k, v in values.items() if k != EXAMPLE_NUMBER}
                if name == "validation" and self.sample_prompt is None:  # what the run's closing sample answers
                    self.sample_prompt = columns["prompt"]
                self.rows.append(columns)
                rows.append({"prompt_ids": ids, "row": len(self.rows) - 1})
            if not rows:
                raise UsageError(f"no {name} prompt of --dataset {cfg.dataset} fits the {room} tokens --block_size "
                                 f"{cfg.block_size} leaves beside --max_completion_length {cfg.max_completion_length}; "
                                 "raise --block_size or lower --max_completion_length")
            splits[name], counts[name] = rows, (len(rows), cut, dropped)
        described = " / ".join(f"{n} {name}" for name, (n, _, _) in counts.items())
        fitted = sum(c for _, c, _ in counts.values()), sum(d for _, _, d in counts.values())
        note = f" ({fitted[0]} cut to their last {room} tokens)" if fitted[0] else ""
        note += f" ({fitted[1]} longer than {room} tokens dropped)" if fitted[1] else ""
        return DatasetDict({name: Dataset.from_list(rows) for name, rows in splits.items()}), f"{described} prompts{note}"

    def _prompt_ids(self, values: dict, tokenizer: PreTrainedTokenizerBase, where: str) -> list[int]:
        prompt = values["prompt"]
        if self.conversational:
            messages = well_formed_messages(prompt, where)
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False))
        if not isinstance(prompt, str) or not prompt:
            raise UsageError(f"{where}: the prompt is {type(prompt).__name__} {prompt!r}, not text or messages; fix "
                             "the row or drop it")
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def _collate(self, data_format: str, tokenizer: PreTrainedTokenizerBase, copies: int = 0) -> Callable | None:
        """Batches of prompts, each `copies` times (0: --num_generations, a training batch's groups)."""
        return PromptCollator(pad_id(tokenizer), copies or self.cfg.num_generations)

    # --- what a vision-language model's prompts add (vision_rollouts.py) ----------------------------

    prompts_have_images = False

    def never_sampled(self) -> tuple[int, ...]:
        """Tokens a completion may not hold (a VLM's image placeholders)."""
        return ()

    def prompt_inputs(self, prompts: dict) -> dict:
        """What the model reads of a prompt batch beside its ids and mask (a VLM's pixels)."""
        return {}

    def with_prompt_inputs(self, batch: dict, prompts: dict) -> dict:
        """A completion batch (prompt + completion rows) with what the model reads of its prompts."""
        return batch

    def saved_batch(self, batch: dict) -> dict:
        """What a checkpoint keeps of a completion batch: all of it (a VLM's
        leaves its pixels out: `restored_batch` remakes them from the rows)."""
        return batch

    def restored_batch(self, batch: dict) -> dict:
        return batch

    def held_out(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> Scored:
        raise UsageError("finetune evaluate scores perplexity; a GRPO run's held-out reward is in its summary.json "
                         "(first_eval / last_eval) and metrics.jsonl")

    # --- the rollout ------------------------------------------------------------------------------

    def rollout(self, prompt_batches: list[dict], number: int) -> list[dict]:
        """The step's micro-batches of completions: sampled, scored, with their
        advantages (and the sampling policy's and the reference's log-probs where
        the loss needs them)."""
        acc, cfg = self.accelerator, self.cfg
        model = self.policy
        was_training = model.training
        model.eval()
        started = time.perf_counter()
        self.sampler.engine.take_seconds()
        with seeded(cfg.seed * 1_000_003 + number * 7919 + acc.process_index, acc.device):
            sampled = [self.sampler.sample(model, b, self.prompt_inputs(b), greedy=False) for b in prompt_batches]
        model.train(was_training)
        engine_metrics = {"rollout_time": time.perf_counter() - started, "weight_sync_time": self.sampler.engine.take_seconds()}
        batches = [self._completion_batch(b, out) for b, out in zip(prompt_batches, sampled)]
        per_function = torch.cat([b.pop("_rewards") for b in batches])
        lengths = torch.cat([b["completion_length"] for b in batches]).cpu().float()
        truncated = torch.cat([b["truncated"] for b in batches]).cpu().float()
        kl_from_reward = cfg.beta > 0 and self.objective.takes_kl_from_reward
        engine_logps = [b.pop("_engine_logps") for b in batches if "_engine_logps" in b]
        correcting = bool(engine_logps) and cfg.vllm_importance_sampling_correction
        if cfg.num_iterations > 1 or kl_from_reward or engine_logps:  # the policy as it sampled: the ratio's denominator
            sampled_logps = [self._token_logps(model, batch) for batch in batches]
            if cfg.num_iterations > 1 or correcting:
                for batch, logps in zip(batches, sampled_logps):
                    batch["old_logps"] = logps
        if engine_logps:
            engine_metrics.update(self._engine_importance(batches, sampled_logps, engine_logps, correcting))
        if cfg.beta > 0:
            for batch in batches:
                batch["reference_logps"] = self.with_reference(model, lambda scorer: self._token_logps(scorer, batch))
        if cfg.num_iterations > 1 or cfg.beta > 0:
            self.backend.after_evaluation(model)  # forwards without backward: FSDP2's root stays gathered
        masks = [next_token_targets(batch["labels"]) != IGNORE for batch in batches]
        kl_sums = (torch.cat([((logps - batch["reference_logps"]) * mask).sum(-1)
                              for logps, batch, mask in zip(sampled_logps, batches, masks)]).cpu()
                   if kl_from_reward else torch.zeros(len(per_function)))
        tokens = torch.cat([mask.sum(-1) for mask in masks]).cpu().float()
        # Every rank's rewards (the batch std, scale_rewards=batch, and the metrics span them all), in one collective.
        gathered = acc.gather(torch.cat([per_function, kl_sums[:, None], tokens[:, None], lengths[:, None],
                                         truncated[:, None]], 1).to(acc.device)).cpu()
        everyone = gathered[:, :len(self.rewards)]
        if torch.isnan(everyone).all() and not self.warned_unscored:
            self.warned_unscored = True
            say(acc, f"warning: every reward function ({', '.join(r.name for r in self.rewards)}) returned None for "
                     f"every completion of rollout {number}: none is scored, every advantage is 0 and nothing is "
                     "learned; None means 'does not apply': check that the functions apply to this data (the "
                     f"columns they get: {', '.join(sorted(self.rows[0])) if self.rows else 'none'})")
        penalty = cfg.beta * gathered[:, -4] if kl_from_reward else None
        advantages = self.objective.advantages(cfg, everyone, self.weights, penalty)
        mine = slice(acc.process_index * len(per_function), (acc.process_index + 1) * len(per_function))
        start = 0
        for batch in batches:
            n = len(batch["input_ids"])
            batch["advantages"] = advantages.advantages[mine][start:start + n].to(acc.device)
            start += n
        self.rollout_metrics = {**self._rollout_metrics(everyone, advantages, gathered[:, -2], gathered[:, -1].bool()),
                                **engine_metrics}
        if kl_from_reward:  # the KL the rewards paid, per completion token (TRL's `kl` of RLOO)
            self.rollout_metrics["kl"] = float(gathered[:, -4].sum() / gathered[:, -3].sum().clamp(min=1))
        if cfg.log_completions_every and number % cfg.log_completions_every == 0 and acc.is_main_process:
            self._log_completions(batches[0], per_function, advantages.advantages[mine], number)
        return batches

    def _engine_importance(self, batches: list[dict], trainer_logps: list[torch.Tensor],
                           engine_logps: list[torch.Tensor], correcting: bool) -> dict[str, float]:
        """The engine's and the trainer's log-probs of the sampled tokens compared
        (TRL's sampling/ metrics, over every rank) and, when correcting, each
        batch's importance weights (grpo_loss.engine_importance)."""
        cfg, acc = self.cfg, self.accelerator
        parts = []
        for batch, trainer, engine in zip(batches, trainer_logps, engine_logps):
            mask = next_token_targets(batch["labels"]) != IGNORE
            ratio, stats = grpo_loss.engine_importance(trainer, engine, mask, cfg.vllm_importance_sampling_mode,
                                                       cfg.vllm_importance_sampling_clip_min,
                                                       cfg.vllm_importance_sampling_clip_max)
            if correcting:
                batch["importance"] = ratio
            parts.append(torch.stack(list(stats.values())))
        names = [f"sampling/{name}" for name in stats]
        everyone = acc.gather(torch.stack(parts).to(acc.device)).cpu()  # [ranks x batches, metrics]
        reduce = {"min": torch.min, "max": torch.max, "mean": torch.mean}
        return {name: float(reduce[name.rsplit("/", 1)[1]](everyone[:, j])) for j, name in enumerate(names)}

    def _completion_batch(self, prompts: dict, sampled: Sampled) -> dict:
        """Training rows of prompt + completion (up to its end-of-text token),
        right-padded, labelled on the completion; the completions' rewards; and
        the engine's log-probs of them where it gives its own, placed as the
        trainer's are (position t scores token t + 1)."""
        completion_ids = sampled.ids
        cfg, eos, pad = self.cfg, self.tokenizer.eos_token_id, pad_id(self.tokenizer)
        prompt_ids, prompt_mask = prompts["prompt_ids"].cpu(), prompts["prompt_mask"].cpu()
        rows = prompts["row"].tolist()
        sequences, labels, kept, truncated = [], [], [], []
        for p_ids, p_mask, c_ids in zip(prompt_ids, prompt_mask, completion_ids.cpu()):
            prompt = p_ids[p_mask.bool()].tolist()
            ends = (c_ids == eos).nonzero()
            length = int(ends[0]) + 1 if len(ends) else len(c_ids)
            completion = c_ids[:length].tolist()
            cut = not len(ends)
            kept.append(completion)
            truncated.append(cut)
            sequences.append(prompt + completion)
            trained = not (cut and cfg.mask_truncated_completions)
            labels.append([IGNORE] * len(prompt) + (completion if trained else [IGNORE] * len(completion)))
        batch = PadCollator(pad)([{"input_ids": seq, "labels": label, "position_ids": list(range(len(seq)))}
                                  for seq, label in zip(sequences, labels)])
        batch["completion_length"] = torch.tensor([len(c) for c in kept])
        batch["truncated"] = torch.tensor(truncated)
        batch["row"] = torch.tensor(rows)
        if sampled.logps is not None:
            placed = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
            for i, (p_mask, completion) in enumerate(zip(prompt_mask, kept)):
                start = int(p_mask.sum()) - 1
                placed[i, start:start + len(completion)] = sampled.logps[i, :len(completion)].cpu()
            batch["_engine_logps"] = placed
        batch = {k: v.to(self.accelerator.device) for k, v in self.with_prompt_inputs(batch, prompts).items()}
        batch["_rewards"] = torch.tensor(self._score(rows, kept), dtype=torch.float32)
        return batch

    def _score(self, rows: list[int], completion_ids: list[list[int]]) -> list[list[float]]:
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts
        values = [self.rows[r] for r in rows]
        columns = self.reward_columns(values)
        return score(self.rewards, [v["prompt"] for v in values], completions, completion_ids, columns,
                     self.cfg.reward_timeout)

    def reward_columns(self, values: list[dict]) -> dict[str, list]:
        """The rows' columns but the prompt, by name, as reward functions get them (TRL's keyword arguments)."""
        return {k: [v[k] for v in values] for k in values[0] if k != "prompt"}

    def _rollout_metrics(self, everyone: torch.Tensor, advantages: grpo_loss.Advantages, lengths: torch.Tensor,
                         truncated: torch.Tensor) -> dict[str, float]:
        """Over every rank's completions: their rewards, lengths and truncation."""
        rewards = advantages.rewards
        metrics = {"reward": float(torch.nanmean(rewards)), "reward_std": float(grpo_loss.nanstd(rewards)),
                   "frac_reward_zero_std": float(advantages.std_is_zero.float().mean())}
        for j, reward in enumerate(self.rewards):
            metrics[f"rewards/{reward.name}/mean"] = float(torch.nanmean(everyone[:, j]))
            metrics[f"rewards/{reward.name}/std"] = float(grpo_loss.nanstd(everyone[:, j]))
        terminated = lengths[~truncated]
        metrics.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                        "completions/max_length": float(lengths.max()),
                        "completions/clipped_ratio": float(truncated.float().mean()),
                        "completions/mean_terminated_length": float(terminated.mean()) if len(terminated) else 0.0})
        return {k: (v if math.isfinite(v) else 0.0) for k, v in metrics.items()}  # nan: no function applied

    def _log_completions(self, batch: dict, per_function: torch.Tensor, advantages: torch.Tensor, number: int) -> None:
        """The main process's first micro-batch, as TRL's completions table:
        in completions.jsonl, and in the trackers that keep tables (W&B, ClearML)."""
        texts = self.tokenizer.batch_decode(
            [ids[mask.bool()][-int(n):].tolist() for ids, mask, n in
             zip(batch["input_ids"].cpu(), batch["attention_mask"].cpu(), batch["completion_length"].cpu())],
            skip_special_tokens=True)
        step = number * self.cfg.num_iterations + 1  # the first step that trains on this rollout
        rows = [{"step": step, "rollout": number, "prompt": self.rows[row]["prompt"], "completion": texts[i],
                 **{f"rewards/{r.name}": per_function[i, j].item() for j, r in enumerate(self.rewards)},
                 "advantage": advantages[i].item()} for i, row in enumerate(batch["row"].tolist())]
        with (self.run_dir / COMPLETIONS_FILE).open("a") as out:
            out.writelines(json_text.dumps(row) + "\n" for row in rows)
        columns = [name for name in rows[0] if name != "rollout"]
        for tracker in self.accelerator.trackers:
            if hasattr(tracker, "log_table"):
                tracker.log_table("completions", columns=columns,
                                  data=[[json.dumps(v) if isinstance(v, list) else v for v in (row[c] for c in columns)]
                                        for row in rows], step=step)

    def _token_logps(self, model, batch: dict) -> torch.Tensor:
        """[B, T] log-probs of each position's target token (0 where none), without gradients."""
        with torch.no_grad():
            return self._scored(model, batch)[0]

    def _scored(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] log-probs of each position's target token (0 where none), and
        the logits they come from: those of the positions from the batch's first
        completion token on (the prompts cost no [tokens, vocab] scores, as in
        TRL), at the sampling temperature (TRL's: the distribution sampled from)."""
        targets = next_token_targets(batch["labels"])
        logits, kept = completion_logits(model, self.inputs(model, batch), targets)
        if self.cfg.temperature != 1.0:
            logits = logits / self.cfg.temperature
        logps = -full_logits_nll(logits, kept)
        return torch.nn.functional.pad(logps, (targets.shape[1] - kept.shape[1], 0)), logits

    # --- loss -------------------------------------------------------------------------------------

    def no_signal_checks(self) -> list[NoSignal]:
        return [*super().no_signal_checks(), NoSignal(
            "frac_reward_zero_std", lambda v: v >= 1.0, 5,
            "every group's completions got the same reward, so every advantage is 0 and nothing is learned; check "
            "the reward functions on the completions in completions.jsonl (they may be too hard or too easy for "
            "this model), or raise --num_generations or --temperature for more varied completions")]

    def targets(self, batch: dict) -> float:
        mask = next_token_targets(batch["labels"]) != IGNORE
        return self.objective.loss_count(self.cfg, mask)

    def loss(self, model, batch: dict) -> LossSum:
        cfg = self.cfg
        if self.sampler is not None:  # an optimizer step follows: the next sampling refreshes a replica
            self.sampler.engine.weights_changed()
        mask = next_token_targets(batch["labels"]) != IGNORE
        logps, logits = self._scored(model, batch)
        terms = self.objective.token_losses(cfg, logps, batch.get("old_logps"), batch["advantages"], mask,
                                            batch.get("reference_logps"), batch.get("importance"))
        total, _ = self.objective.reduced(cfg, terms.losses, mask)
        with torch.no_grad():
            entropy = (grpo_loss.entropy(logits.detach()) * mask[:, mask.shape[1] - logits.shape[1]:]).sum()
        zero = logps.new_zeros(())
        metrics = {"kl": terms.kl.sum().detach() if terms.kl is not None else zero, "entropy": entropy,
                   "clip_ratio/low_mean": terms.low_clipped.sum().to(zero), "clip_ratio/high_mean":
                   terms.high_clipped.sum().to(zero),
                   "clip_ratio/region_mean": (terms.low_clipped | terms.high_clipped).sum().to(zero),
                   "completion_tokens": mask.sum().to(zero)}
        return LossSum(total=total, units=batch["attention_mask"].sum(), metrics=metrics)

    def step_means(self, sums: dict[str, float], count: float) -> dict[str, float]:
        """Token metrics over the step's completion tokens, and the rollout's."""
        tokens = max(sums.pop("completion_tokens"), 1)
        means = {name: value / tokens for name, value in sums.items()}
        if not self.cfg.beta or "kl" in self.rollout_metrics:  # no KL term, or the rewards paid it
            means.pop("kl")
        return {**self.rollout_metrics, **means, "train_time": time.perf_counter() - self.training_started}

    # --- evaluation -------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model, loader, accelerator: Accelerator) -> dict[str, Any]:
        """One greedy completion per held-out prompt, scored; means over the
        prompts (`gather_for_metrics` drops those the sampler repeated)."""
        was_training = model.training
        model.eval()
        sums = torch.zeros(2 + len(self.rewards), dtype=torch.float64)
        counted = 0
        for i, batch in enumerate(loader):
            if self.cfg.max_eval_batches and i >= self.cfg.max_eval_batches:
                break
            ids = self.sampler.sample(model, batch, self.prompt_inputs(batch), greedy=True).ids
            completions = [self._until_end(c) for c in ids.cpu()]
            table = torch.tensor(self._score(batch["row"].tolist(), completions), dtype=torch.float64)
            total = (table * self.weights.double()).nansum(dim=1)
            lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64)
            values = accelerator.gather_for_metrics(torch.cat([total[:, None], lengths[:, None], table], 1)
                                                    .to(accelerator.device)).cpu()
            sums += torch.nan_to_num(values).sum(dim=0)
            counted += len(values)
        model.train(was_training)
        means = (sums / max(counted, 1)).tolist()
        return {"eval_loss": -means[0], "reward": means[0], "eval_completions/mean_length": means[1],
                **{f"eval_rewards/{r.name}/mean": v for r, v in zip(self.rewards, means[2:])}}

    def _until_end(self, ids: torch.Tensor) -> list[int]:
        ends = (ids == self.tokenizer.eos_token_id).nonzero()
        return ids[:int(ends[0]) + 1].tolist() if len(ends) else ids.tolist()


class RolloutBatches:
    """The loop's training batches under GRPO: the prompts' batches (EpochBatches)
    turned into completions, each rollout trained on for --num_iterations steps."""

    def __init__(self, prompts, task: RolloutLM):
        self.prompts, self.task = prompts, task
        self.iterations = task.cfg.num_iterations
        self.buffer: list[dict] = []
        self.uses_left = 0
        self.rollouts = 0          # made so far: numbers each rollout's seed
        self.epoch_ended = False

    def steps_per_epoch(self, accumulation: int) -> int | None:
        steps = self.prompts.steps_per_epoch(accumulation)
        return None if steps is None else steps * self.iterations

    def take(self, epoch: int, count: int) -> list[dict]:
        if self.uses_left == 0:
            prompts = self.prompts.take(epoch, count)
            self.epoch_ended = self.prompts.epoch_ended
            self.buffer = self.task.rollout(prompts, self.rollouts) if prompts else []
            self.rollouts += 1
            self.uses_left = self.iterations
        else:
            self.epoch_ended = False
        self.uses_left -= 1
        self.task.training_started = time.perf_counter()  # the step's forwards, backwards and optimizer step follow
        return self.buffer

    def end_epoch(self) -> None:
        self.prompts.end_epoch()

    def state_dict(self) -> dict:
        """The prompts' position, and the rollout still to be trained on (every
        rank's: a collective), so that a resume trains on the same samples."""
        everyone = []
        if self.uses_left:
            kept = [{k: v.tolist() for k, v in self.task.saved_batch(b).items()} for b in self.buffer]
            everyone = [kept] * self.task.accelerator.num_processes
            if len(everyone) > 1:
                torch.distributed.all_gather_object(everyone, kept)
        return {**self.prompts.state_dict(),
                "rollout": {"made": self.rollouts, "uses_left": self.uses_left, "metrics": self.task.rollout_metrics,
                            "batches_per_rank": everyone}}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)
        saved = state.get("rollout") or {}
        self.rollouts, self.uses_left = int(saved.get("made", 0)), int(saved.get("uses_left", 0))
        self.task.rollout_metrics = dict(saved.get("metrics", {}))
        samples = self.task.run_dir / COMPLETIONS_FILE
        if self.task.accelerator.is_main_process and samples.is_file():  # rollouts after the checkpoint are redone
            kept = [row for row in json_text.read_jsonl(samples)  # a line cut short by a kill goes too
                    if isinstance(row.get("rollout"), int) and row["rollout"] < self.rollouts]
            samples.write_text("".join(json_text.dumps(row) + "\n" for row in kept))
        if not self.uses_left:
            return
        acc, per_rank = self.task.accelerator, saved.get("batches_per_rank", [])
        if len(per_rank) != acc.num_processes:
            raise UsageError(f"the checkpoint was written in the middle of a rollout by {len(per_rank)} rank(s); "
                             f"resume it on {len(per_rank)} (accelerate launch --num_processes {len(per_rank)}), or "
                             "from an earlier checkpoint")
        try:
            self.buffer = [{k: torch.tensor(v, dtype=torch.float32 if k in FLOAT_KEYS else torch.long,
                                            device=acc.device) for k, v in b.items()}
                           for b in per_rank[acc.process_index]]
            problem = self._rollout_problem(self.buffer)
        except (TypeError, ValueError, AttributeError, RuntimeError, OverflowError):
            problem = "its tensors do not load"
        if problem:
            raise UsageError(f"the checkpoint's saved rollout is not one the run made ({problem}); the checkpoint "
                             "is damaged: resume from an earlier one (--resume_from_checkpoint)")
        self.buffer = [self.task.restored_batch(b) for b in self.buffer]

    def _rollout_problem(self, batches: list[dict]) -> str | None:
        """What makes saved micro-batches unlike any rollout: keys, shapes, token ids, rows."""
        if not batches:
            return "no micro-batch"
        vocab = self.task.accelerator.unwrap_model(self.task.policy).config.get_text_config().vocab_size
        needed = {"input_ids", "labels", "attention_mask", "advantages", "completion_length", "row"}
        needed |= {"old_logps"} if self.iterations > 1 else set()
        needed |= {"reference_logps"} if self.task.cfg.beta > 0 else set()
        for batch in batches:
            if missing := sorted(needed - set(batch)):
                return f"a micro-batch without {', '.join(missing)}"
            ids, labels = batch["input_ids"], batch["labels"]
            if ids.dim() != 2 or not len(ids) or labels.shape != ids.shape or batch["attention_mask"].shape != ids.shape:
                return f"a micro-batch of token ids shaped {list(ids.shape)}, labels {list(labels.shape)}"
            if len(batch["advantages"]) != len(ids) or len(batch["row"]) != len(ids):
                return "advantages or rows that do not match the sequences"
            if ids.min() < 0 or ids.max() >= vocab or ((labels != IGNORE) & ((labels < 0) | (labels >= vocab))).any():
                return f"token ids outside the model's vocabulary of {vocab:,}"
            if batch["row"].min() < 0 or batch["row"].max() >= len(self.task.rows):
                return "prompt rows the data does not have"
            if not torch.isfinite(batch["advantages"]).all():
                return "advantages that are not finite"
        return None
