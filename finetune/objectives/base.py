"""What every objective answers (`--method`), and the option sections several
objectives read.

An objective is a class in its own module (sft.py, dpo.py, ...), registered
in __init__.py by its import and its name in the registry. It owns its option section (a dataclass whose
fields are its flags), the sections it shares with others, its data format,
the Task that trains it, its loss, its learning rates, whether it holds a
frozen reference, and what the planner counts for it. Light on purpose: the
config and the command line read it without torch; a loss imports torch where
it computes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from finetune.errors import UsageError
from finetune.options import option


@dataclass
class PromptOptions:
    """preference data"""
    max_prompt_length: int = option(0, "drop (counted) the examples whose prompt has more tokens than this (0 = any "
                                    "prompt that leaves room in --block_size)")


@dataclass
class BetaOptions:
    """preference strength"""
    dpo_beta: float = option(0.1, "TRL's `beta` of the preference objectives: dpo and kto: how far the policy may move "
                             "from the reference; simpo: the reward scale (the SimPO paper uses 2 to 2.5); orpo: the "
                             "odds-ratio term's weight (the paper's lambda)")


@dataclass
class ReferenceOptions:
    """the frozen reference"""
    reference_model: str = option("", "the frozen reference, a HF model dir or Hub id (empty: the starting model, "
                                  "--model; under LoRA the base with the adapters off)")


class Objective:
    name: ClassVar[str]
    summary: ClassVar[str]                       # what it learns, for --method's help
    # "module:Class" of the causal-LM Task that trains it; None: each task's own loss (SFT).
    task_class: ClassVar[str | None] = None
    task_classes: ClassVar[dict[str, str]] = {}  # the Task of another --task it trains, where it has its own
    data_format: ClassVar[str | None] = None     # the one --data_format it trains on (None: any a task reads)
    options: ClassVar[type | None] = None        # its own option section
    shared: ClassVar[tuple[type, ...]] = ()      # the sections it reads with other objectives
    # Fine-tuning learning rates that differ from SFT's, with every parameter trained and under adapters.
    learning_rates: ClassVar[dict[str, float]] = {}
    defaults: ClassVar[dict[str, Any]] = {}      # option values that differ for it (TRL's defaults)
    # What the planner counts: the sequences one data row puts through a forward, and
    # whether it samples completions (a KV cache in place of the training activations).
    sequences_per_row: ClassVar[int] = 1
    samples: ClassVar[bool] = False
    tasks: ClassVar[tuple[str, ...]] = ("causal-lm",)  # the --task values it trains (the first: its default)
    reads_mixtures: ClassVar[bool] = False      # several --dataset sources, or a --streaming one

    @classmethod
    def sections(cls) -> tuple[type, ...]:
        """Every option section it reads."""
        return (*cls.shared, *((cls.options,) if cls.options else ()))

    def check(self, cfg) -> None:
        """Its options' values, in one-line errors, before anything loads."""

    def holds_reference(self, cfg) -> bool:
        """Whether it compares the policy with a frozen reference."""
        return False


def positive(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(f"--{name} must be a positive number, got {value}; pass e.g. "
                             f"{getattr(type(cfg), name, 1)}")


def no_reference_model_under_adapters(cfg) -> None:
    if cfg.reference_model and cfg.peft != "none":
        raise UsageError(f"with --peft {cfg.peft} the reference is the base with the adapters off, so there is "
                         "no --reference_model to load; drop it, or train every parameter (--peft none)")


class PairObjective(Objective):
    """Preference pairs (prompt, chosen, rejected) through one forward, the
    chosen and rejected rows stacked (pairs.py), and a loss on each pair's
    completion log-probs (`pair_losses`)."""
    task_class = "finetune.objectives.pairs:PreferenceLM"
    task_classes = {"image-text-to-text": "finetune.objectives.vision_pairs:VisionPreferenceLM"}
    tasks = ("causal-lm", "image-text-to-text")
    data_format = "preference"
    shared = (PromptOptions, BetaOptions)
    # Preference tuning moves a model much less than SFT: TRL's DPOConfig
    # default for full fine-tuning, and the rate of its LoRA example.
    learning_rates = {"full": 1e-6, "lora": 5e-6}
    sequences_per_row = 2
    reads_chosen_sequence: ClassVar[bool] = False  # its loss reads the NLL of each whole chosen sequence
    metrics: ClassVar[tuple[str, ...]] = ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                          "rewards/margins", "logps/chosen", "logps/rejected")  # TRL's names

    def check(self, cfg) -> None:
        positive(cfg, "dpo_beta")

    def pair_losses(self, cfg, policy, reference):
        """`policy`, `reference` (None without one): preference_loss.PairLogps;
        a preference_loss.PairLosses, one loss a pair, and `metrics` per pair."""
        raise NotImplementedError


IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # TRL's: per token (GRPO), or the sequence's mean (GSPO)
GENERATION_ENGINES = ("auto", "sharded", "replica", "vllm")  # engines.py
VLLM_MODES = ("colocate", "server")
VLLM_IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class RolloutOptions:
    """online RL"""
    reward_funcs: list[str] = option([], "the reward functions, each FILE.py:NAME or module:NAME (your code, imported "
                                     "because this command line names it), or a built-in: exact_match (the "
                                     "completion is the row's answer column), format (it matches --reward_pattern), "
                                     "length_penalty", nargs="+")
    reward_weights: list[float] = option([], "each reward function's weight in the summed reward (empty: 1 each)",
                                         nargs="+")
    reward_pattern: str = option(r"^\S+$", "the regular expression the built-in format reward matches the whole "
                                 "completion (stripped) against")
    reward_timeout: float = option(600.0, "seconds one reward function may take on one micro-batch before the run "
                                   "stops in one line, keeping its last checkpoint (0: no limit)")
    num_generations: int = option(8, "completions sampled per prompt (a group); --per_device_batch_size counts "
                                  "completions and must be a multiple of it")
    max_completion_length: int = option(64, "most tokens sampled per completion (TRL's default is 512, too long for "
                                        "a CPU); the prompt keeps what --block_size leaves")
    temperature: float = option(1.0, "sampling temperature")
    top_p: float = option(1.0, "nucleus sampling's probability mass (1 = off)")
    epsilon: float = option(0.2, "the clipping range of the probability ratio (its lower side)")
    epsilon_high: float = option(0.0, "the upper clipping range (0 = --epsilon; DAPO uses 0.28)")
    num_iterations: int = option(1, "optimizer steps on each batch of samples (above 1 the ratio to the sampling "
                                 "policy moves and clipping acts)")
    importance_sampling_level: str = option("token", "the probability ratio clipped: each token's (GRPO), or the "
                                            "sequence's, the exp of its tokens' mean log-ratio (GSPO, as Qwen3 is "
                                            "trained)", choices=IMPORTANCE_SAMPLING_LEVELS)
    mask_truncated_completions: bool = option(False, "completions cut at --max_completion_length take no part in the "
                                              "loss")
    beta: float = option(0.0, "the KL coefficient against the reference (0 = none; the reference is DPO's: the "
                         "starting model, or the base with the adapters off under LoRA)")
    generation_engine: str = option("auto", "where completions are sampled: the policy as the backend holds it "
                                    "(sharded: FSDP gathers every layer for every token), a whole copy on each rank "
                                    "refreshed after each optimizer step (replica: the same completions as sharded), "
                                    "vLLM's engine in each rank's process (vllm), or auto: vllm on a GPU where it is "
                                    "installed, else the replica where the model is sharded and a copy fits in half "
                                    "of the memory left", choices=GENERATION_ENGINES,
                                    on_resume="from the next rollout (sharded and replica sample alike)")
    log_completions_every: int = option(10, "write a sample of prompts, completions and rewards to "
                                        "RUN_DIR/completions.jsonl every N steps (0 = never)",
                                        on_resume="applies from the next step")


@dataclass
class VLLMOptions:
    """vLLM generation (TRL's names)"""
    use_vllm: bool = option(False, "sample with vLLM: the same as --generation_engine vllm",
                            on_resume="from the next rollout")
    vllm_mode: str = option("colocate", "colocate: vLLM's engine in each rank's process, sharing its GPU with "
                            "training (server, a vLLM server on GPUs of its own, is planned: docs/grpo.md)",
                            choices=VLLM_MODES)
    vllm_gpu_memory_utilization: float = option(0.3, "the share of each GPU's memory vLLM's engine takes for its "
                                                "weights and KV cache, in (0, 1); training keeps the rest",
                                                on_resume="from the next start of the engine")
    vllm_enable_sleep_mode: bool = option(False, "the engine frees its weights and KV cache while the trainer steps "
                                          "and takes them back to sample (slower, more memory for training)",
                                          on_resume="from the next start of the engine")
    vllm_importance_sampling_correction: bool = option(True, "weigh each completion's loss by the trainer's over "
                                                       "the engine's probability of it (their kernels differ), "
                                                       "truncated or masked as --vllm_importance_sampling_mode says")
    vllm_importance_sampling_mode: str = option("sequence_mask", "token_ or sequence_ (one ratio per token, or the "
                                                "completion's product), _truncate (clipped to the bounds) or _mask "
                                                "(0 outside them)", choices=VLLM_IMPORTANCE_SAMPLING_MODES)
    vllm_importance_sampling_clip_max: float = option(3.0, "the importance ratio's upper bound (0: none)")
    vllm_importance_sampling_clip_min: float = option(0.0, "the importance ratio's lower bound (0: none)")


def check_vllm_options(cfg) -> None:
    """vLLM's options, before anything heavy loads; whether vLLM itself runs on this device is checked when it starts."""
    if cfg.use_vllm and cfg.generation_engine not in ("auto", "vllm"):
        raise UsageError(f"--use_vllm asks for vLLM's engine and --generation_engine {cfg.generation_engine} for "
                         "another; pass one of them")
    if not 0.0 < cfg.vllm_gpu_memory_utilization < 1.0:
        raise UsageError(f"--vllm_gpu_memory_utilization must be in (0, 1) (the share of each GPU's memory vLLM "
                         f"takes beside training), got {cfg.vllm_gpu_memory_utilization}; pass e.g. 0.3")
    low, high = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if not (low >= 0 and high >= 0 and math.isfinite(low) and math.isfinite(high)) or (high and low >= high):
        raise UsageError(f"--vllm_importance_sampling_clip_min {low:g} and --vllm_importance_sampling_clip_max {high:g} "
                         "must be finite, >= 0 (0: no bound) and min below max; pass e.g. 0 and 3")
    if "vllm" not in (cfg.generation_engine, "vllm" if cfg.use_vllm else ""):
        return
    if cfg.peft == "qlora":
        raise UsageError("--generation_engine vllm loads the merged weights in the compute dtype, and --peft qlora "
                         "holds the base in 4 bits; pass --peft lora, or --generation_engine auto")
    if cfg.vllm_mode == "server":
        raise UsageError("--vllm_mode server is not built yet (docs/grpo.md has its plan); pass --vllm_mode colocate, "
                         "vLLM's engine in each rank's process")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UsageError("--generation_engine vllm needs vLLM, which is not installed here; pip install vllm where "
                         "the GPUs are, or pass --generation_engine auto (a replica or the sharded model)")


class RolloutObjective(Objective):
    """The policy's own samples of each prompt, in groups, scored by reward
    functions (rollouts.py); the objective says what a completion's advantage
    is and how its tokens' losses are reduced."""
    task_class = "finetune.objectives.rollouts:RolloutLM"
    task_classes = {"image-text-to-text": "finetune.objectives.vision_rollouts:VisionRolloutLM"}
    tasks = ("causal-lm", "image-text-to-text")
    data_format = "prompt"
    shared = (RolloutOptions, VLLMOptions, ReferenceOptions)
    learning_rates = {"full": 1e-6, "lora": 1e-5}  # TRL's GRPOConfig rate; its LoRA examples use 1e-5
    samples = True
    # The KL to the reference is taken from the rewards (RLOO), not added to the loss (GRPO).
    takes_kl_from_reward: ClassVar[bool] = False

    def holds_reference(self, cfg) -> bool:
        return cfg.beta > 0

    def check(self, cfg) -> None:
        for name in ("num_generations", "max_completion_length", "num_iterations"):
            if getattr(cfg, name) <= 0:
                raise UsageError(f"--{name} must be > 0, got {getattr(cfg, name)}; pass a positive value")
        if cfg.num_generations < 2:
            raise UsageError(f"--num_generations {cfg.num_generations}: a group needs 2 or more completions of a "
                             "prompt to compare (its advantages are rewards against the group's others); pass e.g. 8")
        if cfg.per_device_batch_size % cfg.num_generations:
            fitting = cfg.num_generations * max(1, cfg.per_device_batch_size // cfg.num_generations)
            raise UsageError(f"--per_device_batch_size {cfg.per_device_batch_size} (completions per micro-batch) is "
                             f"not a multiple of --num_generations {cfg.num_generations}; each micro-batch holds whole "
                             f"groups: pass --per_device_batch_size {fitting} or change --num_generations")
        if cfg.max_completion_length >= cfg.block_size:
            raise UsageError(f"--max_completion_length {cfg.max_completion_length} leaves no room for a prompt in "
                             f"--block_size {cfg.block_size}; raise --block_size or lower --max_completion_length")
        positive(cfg, "temperature")
        if not 0.0 < cfg.top_p <= 1.0:
            raise UsageError(f"--top_p must be in (0, 1], got {cfg.top_p}; pass e.g. 1.0")
        if not (0.0 <= cfg.epsilon < 1.0):
            raise UsageError(f"--epsilon must be in [0, 1), got {cfg.epsilon}; pass e.g. 0.2")
        if cfg.epsilon_high and not (cfg.epsilon_high > 0 and math.isfinite(cfg.epsilon_high)):
            raise UsageError(f"--epsilon_high must be a positive number (0: the same as --epsilon), got "
                             f"{cfg.epsilon_high}; pass e.g. 0.28")
        if not (cfg.beta >= 0 and math.isfinite(cfg.beta)):
            raise UsageError(f"--beta (the KL coefficient) must be >= 0, got {cfg.beta}; pass 0 (no KL) or e.g. 0.04")
        if not (cfg.reward_timeout >= 0 and math.isfinite(cfg.reward_timeout)):
            raise UsageError(f"--reward_timeout must be >= 0 seconds (0: no limit), got {cfg.reward_timeout}; pass "
                             "e.g. 600")
        if cfg.reward_timeout and cfg.reward_timeout >= cfg.ddp_timeout:
            raise UsageError(f"--reward_timeout {cfg.reward_timeout:g} is not below --ddp_timeout {cfg.ddp_timeout}: "
                             "the other ranks would give up on a slow reward first, without naming it; lower "
                             "--reward_timeout or raise --ddp_timeout")
        if cfg.beta == 0 and cfg.reference_model:
            raise UsageError(f"--reference_model {cfg.reference_model} is read only for the KL term, and --beta is 0 "
                             "(no KL term); pass --beta > 0 (e.g. 0.04), or drop --reference_model")
        if not cfg.reward_funcs:
            raise UsageError(f"--method {cfg.objective} needs --reward_funcs: a FILE.py:NAME or module:NAME of yours, "
                             "or a built-in (exact_match, format, length_penalty); see docs/grpo.md")
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
        no_reference_model_under_adapters(cfg)
        if cfg.task == "image-text-to-text" and "vllm" in (cfg.generation_engine, "vllm" if cfg.use_vllm else ""):
            raise UsageError("--generation_engine vllm is given token ids alone, and --task image-text-to-text's "
                             "prompts hold images; pass --generation_engine auto (a replica or the sharded model)")
        check_vllm_options(cfg)

    # --- the arithmetic rollouts.py asks for (torch tensors) --------------------------------------

    def advantages(self, cfg, per_function, weights, penalty=None):
        """`per_function`: [N, F] rewards (NaN where a function returned None),
        N completions in groups of num_generations consecutive rows; `weights`
        [F]; `penalty` [N]: what `takes_kl_from_reward` takes from each reward
        (beta times its summed KL to the reference), else None. A grpo_loss.Advantages."""
        raise NotImplementedError

    def token_losses(self, cfg, logps, old_logps, advantages, mask, reference_logps, importance=None):
        """[B, T] log-probs of the completion tokens under the policy, as it
        sampled (None: the same, detached) and under the reference (None
        without one); [B] advantages; `importance`: [B, T] or [B, 1] weights
        of the policy term (vLLM's correction; None: 1). A grpo_loss.TokenLosses."""
        raise NotImplementedError

    def loss_count(self, cfg, mask) -> float:
        """What a micro-batch's summed loss is divided by over the global batch, known before its forward."""
        raise NotImplementedError

    def reduced(self, cfg, losses, mask):
        """(sum, count) of a micro-batch's [B, T] token losses."""
        raise NotImplementedError
