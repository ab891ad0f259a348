"""The objective registry: what the loss learns from (`--method`), by name.

An objective owns its data format, its options (checked here, in its own
section), its loss and metrics, and what it needs from a reference. `sft` is
each task's own loss; the others are causal-LM tasks with another loss, in
their own modules:

    dpo, simpo   preference.py: pairs of completions, one forward (preference_loss.py)
    grpo         grpo.py: the policy's own samples, scored by reward functions (grpo_loss.py, rewards.py)

Adding one (KTO, ORPO, RLOO) means a module with its Task subclass and a line
here. This module is light on purpose: the config and the command line read it
without importing torch.
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from finetune.errors import UsageError


@dataclass(frozen=True)
class ObjectiveEntry:
    name: str
    task_class: str | None            # "module:Class" of its causal-LM Task; None: each task's own loss
    data_format: str | None           # the one --data_format it trains on (None: any the task reads)
    options: tuple[str, ...] = ()     # the options only it reads (refused on the command line for the others)
    # Fine-tuning learning rates that differ from SFT's, full and under LoRA.
    learning_rates: dict[str, float] = field(default_factory=dict)
    check: Callable[[Any], None] = lambda cfg: None  # its options' values, in one-line errors

    def load_class(self) -> type:
        module, name = self.task_class.split(":")
        return getattr(importlib.import_module(module), name)


def _positive(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(f"--{name} must be a positive number, got {value}; pass e.g. "
                             f"{getattr(type(cfg), name, 1)}")


def _no_reference_model_under_adapters(cfg) -> None:
    if cfg.reference_model and cfg.peft != "none":
        raise UsageError(f"with --peft {cfg.peft} the reference is the base with the adapters off, so there is "
                         "no --reference_model to load; drop it, or train every parameter (--peft none)")


def check_preference(cfg) -> None:
    _positive(cfg, "dpo_beta")
    if not math.isfinite(cfg.simpo_gamma):
        raise UsageError(f"--simpo_gamma must be a number, got {cfg.simpo_gamma}; pass e.g. 0.5")
    _no_reference_model_under_adapters(cfg)


GRPO_LOSSES = ("grpo", "dapo", "dr_grpo", "bnpo")  # TRL's names and formulas
SCALE_REWARDS = ("group", "batch", "none")           # TRL's: the std the advantages are divided by


def check_grpo(cfg) -> None:
    for name in ("num_generations", "max_completion_length", "num_iterations"):
        if getattr(cfg, name) <= 0:
            raise UsageError(f"--{name} must be > 0, got {getattr(cfg, name)}; pass a positive value")
    if cfg.num_generations < 2:
        raise UsageError(f"--num_generations {cfg.num_generations}: a group needs 2 or more completions of a prompt "
                         "to compare (its advantages are rewards minus the group's mean); pass e.g. 8")
    if cfg.per_device_batch_size % cfg.num_generations:
        raise UsageError(f"--per_device_batch_size {cfg.per_device_batch_size} (completions per micro-batch) is not "
                         f"a multiple of --num_generations {cfg.num_generations}; each micro-batch holds whole "
                         f"groups: pass --per_device_batch_size {cfg.num_generations * max(1, cfg.per_device_batch_size // cfg.num_generations)}"
                         " or change --num_generations")
    if cfg.max_completion_length >= cfg.block_size:
        raise UsageError(f"--max_completion_length {cfg.max_completion_length} leaves no room for a prompt in "
                         f"--block_size {cfg.block_size}; raise --block_size or lower --max_completion_length")
    _positive(cfg, "temperature")
    if not 0.0 < cfg.top_p <= 1.0:
        raise UsageError(f"--top_p must be in (0, 1], got {cfg.top_p}; pass e.g. 1.0")
    if not (0.0 <= cfg.epsilon < 1.0):
        raise UsageError(f"--epsilon must be in [0, 1), got {cfg.epsilon}; pass e.g. 0.2")
    if cfg.epsilon_high and not (cfg.epsilon_high > 0 and math.isfinite(cfg.epsilon_high)):
        raise UsageError(f"--epsilon_high must be a positive number (0: the same as --epsilon), got "
                         f"{cfg.epsilon_high}; pass e.g. 0.28")
    if not (cfg.beta >= 0 and math.isfinite(cfg.beta)):
        raise UsageError(f"--beta (the KL coefficient) must be >= 0, got {cfg.beta}; pass 0 (no KL, TRL's default) "
                         "or e.g. 0.04")
    if cfg.loss_type not in GRPO_LOSSES:
        raise UsageError(f"--loss_type {cfg.loss_type!r} is not supported; choose one of {', '.join(GRPO_LOSSES)}")
    if cfg.scale_rewards not in SCALE_REWARDS:
        raise UsageError(f"--scale_rewards {cfg.scale_rewards!r} is not supported; choose one of "
                         f"{', '.join(SCALE_REWARDS)}")
    if not (cfg.reward_timeout >= 0 and math.isfinite(cfg.reward_timeout)):
        raise UsageError(f"--reward_timeout must be >= 0 seconds (0: no limit), got {cfg.reward_timeout}; pass e.g. 600")
    if cfg.reward_timeout and cfg.reward_timeout >= cfg.ddp_timeout:
        raise UsageError(f"--reward_timeout {cfg.reward_timeout:g} is not below --ddp_timeout {cfg.ddp_timeout}: the "
                         "other ranks would give up on a slow reward first, without naming it; lower "
                         "--reward_timeout or raise --ddp_timeout")
    if cfg.beta == 0 and cfg.reference_model:
        raise UsageError(f"--reference_model {cfg.reference_model} is read only for the KL term, and --beta is 0 "
                         "(no KL term, TRL's default); pass --beta > 0 (e.g. 0.04), or drop --reference_model")
    if not cfg.reward_funcs:
        raise UsageError("--method grpo needs --reward_funcs: a FILE.py:NAME or module:NAME of yours, or a built-in "
                         "(exact_match, format, length_penalty); see docs/grpo.md")
    if "format" in cfg.reward_funcs:
        try:
            re.compile(cfg.reward_pattern)
        except re.error as e:
            raise UsageError(f"--reward_pattern {cfg.reward_pattern!r} is not a regular expression ({e}); fix it "
                             "(the built-in format reward matches it against each whole completion)") from None
    if cfg.reward_weights and len(cfg.reward_weights) != len(cfg.reward_funcs):
        raise UsageError(f"--reward_weights has {len(cfg.reward_weights)} weight(s) for {len(cfg.reward_funcs)} "
                         "--reward_funcs; give one weight per function, in the same order")
    if not all(math.isfinite(w) for w in cfg.reward_weights):
        raise UsageError("--reward_weights must be finite numbers; pass e.g. 1.0 0.5")
    _no_reference_model_under_adapters(cfg)


def check_router(cfg) -> None:
    if cfg.output_router_logits and cfg.task != "causal-lm":
        raise UsageError(f"--output_router_logits applies to mixture-of-experts language models, not --task "
                         f"{cfg.task}; drop it")
    if not math.isfinite(cfg.router_aux_loss_coef):
        raise UsageError(f"--router_aux_loss_coef must be a number, got {cfg.router_aux_loss_coef}; pass e.g. 0.001")
    if cfg.router_aux_loss_coef >= 0 and not cfg.output_router_logits:
        raise UsageError(f"--router_aux_loss_coef {cfg.router_aux_loss_coef:g} weighs the routers' load-balancing "
                         "loss, which only --output_router_logits adds; add --output_router_logits")


ROUTER_OPTIONS = ("output_router_logits", "router_aux_loss_coef")
PREFERENCE_OPTIONS = ("dpo_beta", "max_prompt_length")
GRPO_OPTIONS = ("reward_funcs", "reward_weights", "reward_timeout", "num_generations", "max_completion_length", "temperature", "top_p",
                "loss_type", "epsilon", "epsilon_high", "num_iterations", "scale_rewards",
                "mask_truncated_completions", "beta", "log_completions_every", "reward_pattern")

REGISTRY: dict[str, ObjectiveEntry] = {entry.name: entry for entry in (
    ObjectiveEntry("sft", None, None, ROUTER_OPTIONS, check=check_router),
    # Preference tuning moves a model much less than SFT: TRL's DPOConfig
    # default for full fine-tuning, and the rate of its LoRA example.
    ObjectiveEntry("dpo", "finetune.objectives.preference:PreferenceLM", "preference",
                   (*PREFERENCE_OPTIONS, "dpo_loss", "reference_model", "precompute_reference"),
                   {"full": 1e-6, "lora": 5e-6}, check_preference),
    ObjectiveEntry("simpo", "finetune.objectives.preference:PreferenceLM", "preference",
                   (*PREFERENCE_OPTIONS, "simpo_gamma"), {"full": 1e-6, "lora": 5e-6}, check_preference),
    # TRL's GRPOConfig learning rate is 1e-6; its LoRA examples use 1e-5.
    ObjectiveEntry("grpo", "finetune.objectives.grpo:GRPOLM", "prompt", (*GRPO_OPTIONS, "reference_model"),
                   {"full": 1e-6, "lora": 1e-5}, check_grpo),
)}

OBJECTIVES = tuple(REGISTRY)


def objective_of_option(name: str) -> tuple[str, ...]:
    """The objectives that read an option (empty: every one)."""
    return tuple(entry.name for entry in REGISTRY.values() if name in entry.options)
