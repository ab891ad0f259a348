"""RLOO's advantages and loss (finetune/objectives/rloo.py) and GSPO's
sequence-level ratio (grpo.py, rloo.py) for a fixed rollout (test_objectives_grpo's):
against the formulas written here with transformers alone, and against TRL's
RLOOTrainer and GRPOTrainer scoring the same completions with the same models
and advantages."""

from __future__ import annotations

import pytest
import torch

from finetune.config import TrainConfig
from finetune.objectives import grpo_loss
from finetune.objectives.engines import Sampled
from finetune.objectives.rollouts import RolloutLM
from tests.sft_models import chat_tokenizer, conversations, tiny_llama
from tests.unit.test_objectives_grpo import COMPLETION_LENGTH, GROUPS, fixed_rollout, grpo_task, moved

EPSILON = (0.2, 0.28)


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer([m["content"] for row in conversations(60) for m in row["messages"]])


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(tokenizer)


def rollout_task(tokenizer, objective: str, **options) -> RolloutLM:
    if objective == "grpo":
        return grpo_task(tokenizer, **options)
    task = grpo_task(tokenizer)
    task.cfg = TrainConfig(**{**task.cfg.to_dict(), "objective": objective, "loss_type": "dapo", **options})
    return task


def our_step(task: RolloutLM, model, prompt_batch, completions, old_model=None, reference=None) -> dict:
    """The rollout's rows, advantages (the KL taken from the rewards for RLOO)
    and loss as a step computes them, the two prompts' groups as two micro-batches."""
    cfg = task.cfg
    halves = [{k: v[i * GROUPS:(i + 1) * GROUPS] for k, v in prompt_batch.items()} for i in range(2)]
    batches = [task._completion_batch(h, Sampled(completions[i * GROUPS:(i + 1) * GROUPS])) for i, h in enumerate(halves)]
    per_function = torch.cat([b.pop("_rewards") for b in batches])
    penalty = None
    if reference is not None:
        sampled = [task._token_logps(old_model or model, b) for b in batches]
        masks = [b["labels"][:, 1:] != -100 for b in batches]
        penalty = cfg.beta * torch.cat([((s[:, :-1] - task._token_logps(reference, b)[:, :-1]) * m).sum(-1)
                                        for s, b, m in zip(sampled, batches, masks)])
    advantages = task.objective.advantages(cfg, per_function, task.weights, penalty)
    for i, b in enumerate(batches):
        b["advantages"] = advantages.advantages[i * GROUPS:(i + 1) * GROUPS]
        if old_model is not None:
            b["old_logps"] = task._token_logps(old_model, b)
    count = sum(task.targets(b) for b in batches)
    loss = sum(float(task.loss(model, b).total.detach()) for b in batches) / count
    return {"loss": loss, "advantages": advantages.advantages, "rewards": advantages.rewards}


def completion_logps(m, prompt: list[int], ids: list[int]) -> torch.Tensor:
    sequence = prompt + ids
    logits = m(torch.tensor([sequence])).logits[0, -len(ids) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def by_hand(model, prompts, texts, rewards, objective, level, old_model=None, reference=None, beta=0.0) -> dict:
    """TRL's RLOO (leave-one-out advantages, the KL from the reward, one
    clipped term a sequence) or GRPO's `grpo` loss with GSPO's ratio, one
    unpadded sequence at a time."""
    logps, olds, refs = [], [], []
    for i, ids in enumerate(texts):
        prompt = prompts[i // GROUPS]
        with torch.no_grad():
            logps.append(completion_logps(model, prompt, ids))
            olds.append(completion_logps(old_model, prompt, ids) if old_model else logps[-1])
            refs.append(completion_logps(reference, prompt, ids) if reference else None)
    rewards = torch.tensor(rewards, dtype=torch.float64)
    if objective == "rloo":
        if beta:
            rewards = rewards - beta * torch.stack([(o - r).sum() for o, r in zip(olds, refs)])
        groups = rewards.view(-1, GROUPS)
        advantages = (groups - (groups.sum(1, keepdim=True) - groups) / (GROUPS - 1)).flatten()
    else:
        groups = rewards.view(-1, GROUPS)
        advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    losses = []
    for lp, old, a in zip(logps, olds, advantages):
        log_ratio = (lp - old).sum() if objective == "rloo" and level == "token" else (lp - old).mean()
        ratio = torch.exp(log_ratio)
        losses.append(-torch.min(ratio * a, ratio.clamp(1 - EPSILON[0], 1 + EPSILON[1]) * a))
    return {"loss": float(sum(losses) / len(losses)), "advantages": advantages}


@pytest.mark.parametrize("objective, level, beta", [("rloo", "token", 0.0), ("rloo", "token", 0.05),
                                                    ("rloo", "sequence", 0.0), ("grpo", "sequence", 0.0)])
def test_advantages_and_loss_match_the_formulas(tokenizer, model, objective, level, beta):
    options = dict(importance_sampling_level=level, epsilon=EPSILON[0], epsilon_high=EPSILON[1], num_iterations=2,
                   beta=beta, **({"loss_type": "grpo"} if objective == "grpo" else {}))
    task = rollout_task(tokenizer, objective, **options)
    prompts, texts, prompt_batch, completions = fixed_rollout(task, tokenizer, seed=1)
    old_model = moved(model, 2.0, seed=5)  # the policy that sampled has moved: the ratios are not 1
    reference = moved(model, 0.3, seed=3) if beta else None
    got = our_step(task, model, prompt_batch, completions, old_model, reference)
    rewards = [float(i % GROUPS == 1) + 0.5 * -len(ids) / COMPLETION_LENGTH for i, ids in enumerate(texts)]
    want = by_hand(model, prompts, texts, rewards, objective, level, old_model, reference, beta)
    assert got["advantages"].tolist() == pytest.approx(want["advantages"].tolist(), abs=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-5)
    assert abs(want["loss"]) > 1e-3  # moved policies: a loss that is not the advantages' mean (0)


def trl_inputs(prompt_batch, completions, tokenizer, advantages: torch.Tensor) -> dict:
    """TRL's rollout layout: left-padded prompts, right-padded completions up to their end-of-text token."""
    eos = tokenizer.eos_token_id
    mask = torch.zeros_like(completions)
    for i, row in enumerate(completions.tolist()):
        mask[i, :row.index(eos) + 1 if eos in row else len(row)] = 1
    return {"prompt_ids": prompt_batch["prompt_ids"], "prompt_mask": prompt_batch["prompt_mask"],
            "completion_ids": completions, "completion_mask": mask, "advantages": advantages.float()}


def exact_logps(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **unused):
    """TRL's `_get_per_token_logps_and_entropies`, from the full logits in float64."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1:-1].double()
    logprobs = torch.log_softmax(logits, -1)
    picked = logprobs.gather(2, input_ids[:, -logits_to_keep:, None])[..., 0]
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return picked.float(), entropy.float() if compute_entropy else None, None


@pytest.mark.parametrize("objective", ["rloo", "gspo"])
def test_the_loss_equals_trls_trainer_on_the_same_completions(tokenizer, model, objective, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    ours_name = "grpo" if objective == "gspo" else "rloo"
    task = rollout_task(tokenizer, ours_name, epsilon=EPSILON[0], epsilon_high=EPSILON[1], num_iterations=2,
                        **({"importance_sampling_level": "sequence", "loss_type": "grpo"} if objective == "gspo"
                           else {"beta": 0.0}))
    _, _, prompt_batch, completions = fixed_rollout(task, tokenizer, seed=1)
    # Both groups of the first prompt: TRL scores left-padded prompts at shifted positions, so none is padded.
    prompt_batch = {**prompt_batch, "prompt_ids": prompt_batch["prompt_ids"][[0] * 2 * GROUPS],
                    "prompt_mask": prompt_batch["prompt_mask"][[0] * 2 * GROUPS]}
    old_model = moved(model, 2.0, seed=5)
    got = our_step(task, model, prompt_batch, completions, old_model)
    common = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=2 * GROUPS,
                  num_generations=GROUPS, max_completion_length=COMPLETION_LENGTH, epsilon=EPSILON[0],
                  epsilon_high=EPSILON[1], num_iterations=2, beta=0.0, disable_tqdm=True)
    if objective == "gspo":
        args, trainer_class = GRPOConfig(**common, loss_type="grpo", importance_sampling_level="sequence"), GRPOTrainer
    else:
        args, trainer_class = RLOOConfig(**common), RLOOTrainer
    trainer = trainer_class(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                            args=args, train_dataset=Dataset.from_list([{"prompt": "name it"}] * 8),
                            processing_class=tokenizer)
    inputs = trl_inputs(prompt_batch, completions, tokenizer, got["advantages"])
    old = torch.zeros(completions.shape)  # the sampling policy's per-token log-probs, in TRL's layout
    for i, (prompt, row) in enumerate(zip(inputs["prompt_ids"].tolist(), completions.tolist())):
        kept, real = int(inputs["completion_mask"][i].sum()), prompt[len(prompt) - int(inputs["prompt_mask"][i].sum()):]
        with torch.no_grad():
            old[i, :kept] = completion_logps(old_model, real, row[:kept]).float()
    if objective == "gspo":
        inputs["old_per_token_logps"] = old
    else:
        inputs["old_logps"] = (old * inputs["completion_mask"]).sum(1)
    trainer.model.eval()  # one micro-batch: no accumulation normalizer
    # TRL's fused LM head scores tokens ~4e-4 off log_softmax in fp32 on this model; its loss arithmetic gets
    # the exact per-token log-probs, as ours does.
    trainer._get_per_token_logps_and_entropies = exact_logps
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs)
    assert float(loss) == pytest.approx(got["loss"], rel=1e-5, abs=1e-5)


def test_leave_one_out_skips_unscored_completions_and_normalizes_over_the_batch():
    per_function = torch.tensor([[1.0], [0.0], [float("nan")], [1.0], [2.0], [2.0], [2.0], [float("nan")]])
    out = grpo_loss.leave_one_out_advantages(per_function, torch.ones(1), 4, None, normalize=False)
    # group 1: scored 1, 0, 1 -> each against the mean of the other two scored; the unscored one gets 0
    assert out.advantages.tolist() == pytest.approx([0.5, -1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    assert out.std_is_zero.tolist() == [False] * 4 + [True] * 4
    normalized = grpo_loss.leave_one_out_advantages(per_function, torch.ones(1), 4, None, normalize=True)
    scored = torch.tensor([0.5, -1.0, 0.5, 0.0, 0.0, 0.0])
    expected = (scored - scored.mean()) / (scored.std() + 1e-4)
    assert normalized.advantages[[0, 1, 3, 4, 5, 6]].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
