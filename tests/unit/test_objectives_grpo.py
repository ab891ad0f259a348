"""GRPO's training rows, advantages, loss and metrics (finetune/objectives/grpo.py
and grpo_loss.py) against a computation written here from the formulas, with
transformers alone: each completion scored on its own, unpadded, and TRL's
per-micro-batch reductions (sampling bypassed: the completions are fixed)."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from finetune.config import TrainConfig
from finetune.errors import UsageError
from finetune.objectives import grpo_loss
from finetune.objectives.engines import Sampled
from finetune.objectives.rollouts import PromptCollator, RolloutLM
from tests.sft_models import chat_tokenizer, conversations

GROUPS = 4
COMPLETION_LENGTH = 6


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer([m["content"] for row in conversations(60) for m in row["messages"]])


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()


def moved(model, scale: float, seed: int):
    """A copy with every weight nudged: the policy that sampled, or the reference."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.std().clamp(min=1e-3))
    return other


def grpo_task(tokenizer, **options) -> RolloutLM:
    cfg = TrainConfig(objective="grpo", reward_funcs=["exact_match", "length_penalty"], reward_weights=[1.0, 0.5],
                      num_generations=GROUPS, per_device_batch_size=2 * GROUPS,
                      max_completion_length=COMPLETION_LENGTH, block_size=64, **options)
    task = RolloutLM(cfg)
    task.tokenizer, task.accelerator = tokenizer, SimpleNamespace(device=torch.device("cpu"))
    return task


def fixed_rollout(task: RolloutLM, tokenizer, seed: int):
    """Two prompts (of different lengths, left-padded as the collator pads
    them) and GROUPS completions each: some end early, some run to the limit;
    one of each group says the answer."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [tokenizer("what is the answer", add_special_tokens=False)["input_ids"],
               tokenizer("name it", add_special_tokens=False)["input_ids"]]
    task.rows = [{"prompt": "what is the answer", "answer": "blue"}, {"prompt": "name it", "answer": "sky"}]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    completions, texts = [], []
    for i in range(2 * GROUPS):
        length = [2, COMPLETION_LENGTH, 4, COMPLETION_LENGTH][i % GROUPS]
        if i % GROUPS == 1:  # the answer, then the end
            ids = tokenizer(task.rows[i // GROUPS]["answer"], add_special_tokens=False)["input_ids"] + [eos]
        else:
            ids = torch.randint(10, len(tokenizer), (length,), generator=generator).tolist()
            ids = ids if length == COMPLETION_LENGTH else ids[:-1] + [eos]
        texts.append(ids)
        completions.append(ids + [pad] * (COMPLETION_LENGTH - len(ids)))
    # Each prompt GROUPS times in a row, as the training loader's collator gives them.
    prompt_batch = PromptCollator(pad, GROUPS)([{"prompt_ids": p, "row": i} for i, p in enumerate(prompts)])
    return prompts, texts, prompt_batch, torch.tensor(completions)


def independent(model, prompts, completions, rewards, loss_type, epsilon, beta, old_model, reference, mask_cut, eos,
                temperature=1.0):
    """TRL's formulas, one unpadded sequence at a time, on the logits at the sampling temperature."""
    rewards = torch.tensor(rewards, dtype=torch.float64)
    groups = rewards.view(-1, GROUPS)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    per_sequence, kls, entropies, tokens, low, high = [], [], [], 0, 0, 0

    def logps_of(m, sequence, n):
        logits = m(torch.tensor([sequence])).logits[0, -n - 1:-1].double() / temperature
        return torch.log_softmax(logits, -1), torch.tensor(sequence[-n:])

    for i, ids in enumerate(completions):
        sequence = prompts[i // GROUPS] + ids
        n = len(ids)
        trained = not (mask_cut and ids[-1] != eos)
        logp_all, target = logps_of(model, sequence, n)
        logps = logp_all.gather(1, target[:, None])[:, 0]
        old = logps_of(old_model, sequence, n)[0].gather(1, target[:, None])[:, 0] if old_model else logps.detach()
        ratio = torch.exp(logps - old)
        a = advantages[i]
        loss = -torch.min(ratio * a, ratio.clamp(1 - epsilon[0], 1 + epsilon[1]) * a)
        if beta:
            ref = logps_of(reference, sequence, n)[0].gather(1, target[:, None])[:, 0]
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            loss = loss + beta * kl
            kls.append(kl.sum() if trained else kl.sum() * 0)
        entropies.append(-(logp_all.exp() * logp_all).sum(-1).sum() if trained else torch.tensor(0.0))
        low += int(((ratio < 1 - epsilon[0]) & (a < 0)).sum()) if trained else 0
        high += int(((ratio > 1 + epsilon[1]) & (a > 0)).sum()) if trained else 0
        per_sequence.append((loss.sum() if trained else loss.sum() * 0, n if trained else 0))
        tokens += n if trained else 0
    halves = [per_sequence[:GROUPS], per_sequence[GROUPS:]]  # the two micro-batches
    if loss_type == "dapo":
        value = sum(s for s, _ in per_sequence) / tokens
    elif loss_type == "grpo":
        value = sum(s / max(n, 1) for s, n in per_sequence) / len(per_sequence)
    elif loss_type == "dr_grpo":
        value = sum(s for s, _ in per_sequence) / (len(per_sequence) * COMPLETION_LENGTH)
    else:  # bnpo: each micro-batch's token mean, averaged over the micro-batches
        value = sum(sum(s for s, _ in h) / max(sum(n for _, n in h), 1) for h in halves) / len(halves)
    return {"loss": float(value), "advantages": advantages, "kl": float(sum(kls) / tokens) if beta else None,
            "entropy": float(sum(entropies) / tokens), "clip_ratio/low_mean": low / tokens,
            "clip_ratio/high_mean": high / tokens, "clip_ratio/region_mean": (low + high) / tokens}


def ours(task, model, prompt_batch, completions, old_model=None, reference=None):
    """The rows, advantages and loss as a step computes them, the two prompts'
    groups as two micro-batches."""
    halves = [{k: v[i * GROUPS:(i + 1) * GROUPS] for k, v in prompt_batch.items()} for i in range(2)]
    batches = [task._completion_batch(h, Sampled(completions[i * GROUPS:(i + 1) * GROUPS])) for i, h in enumerate(halves)]
    per_function = torch.cat([b.pop("_rewards") for b in batches])
    adv = grpo_loss.group_advantages(per_function, task.weights, GROUPS, task.cfg.scale_rewards)
    for i, b in enumerate(batches):
        b["advantages"] = adv.advantages[i * GROUPS:(i + 1) * GROUPS]
        if old_model is not None:
            b["old_logps"] = task._token_logps(old_model, b)
        if reference is not None:
            b["reference_logps"] = task._token_logps(reference, b)
    count = sum(task.targets(b) for b in batches)
    terms = [task.loss(model, b) for b in batches]
    sums = {name: sum(float(t.metrics[name]) for t in terms) for name in task.step_metrics}
    task.rollout_metrics = {}
    return {"loss": sum(float(t.total.detach()) for t in terms) / count, "advantages": adv.advantages,
            "rewards": adv.rewards, **task.step_means(sums, count)}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_loss_advantages_and_metrics_match_the_formulas(tokenizer, model, loss_type, beta, num_iterations):
    epsilon = (0.2, 0.28)
    temperature = 0.7 if beta else 1.0  # the log-probs are of the distribution sampled from
    task = grpo_task(tokenizer, loss_type=loss_type, beta=beta, num_iterations=num_iterations, epsilon=epsilon[0],
                     epsilon_high=epsilon[1], temperature=temperature)
    prompts, texts, prompt_batch, completions = fixed_rollout(task, tokenizer, seed=1)
    # num_iterations 2: the second step's policy has moved from the one that sampled.
    old_model = moved(model, 2.0, seed=5) if num_iterations > 1 else None
    reference = moved(model, 0.3, seed=3) if beta else None
    got = ours(task, model, prompt_batch, completions, old_model, reference)
    rewards = [float(i % GROUPS == 1) + 0.5 * -len(ids) / COMPLETION_LENGTH for i, ids in enumerate(texts)]
    want = independent(model, prompts, texts, rewards, loss_type, epsilon, beta, old_model, reference, False,
                       tokenizer.eos_token_id, temperature)
    assert got["rewards"].tolist() == pytest.approx(rewards, abs=1e-6)
    assert got["advantages"].tolist() == pytest.approx(want["advantages"].tolist(), abs=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    for name in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert got[name] == pytest.approx(want[name], abs=1e-5), name
    if beta:
        assert got["kl"] == pytest.approx(want["kl"], abs=1e-5) and want["kl"] > 0
    else:
        assert "kl" not in got
    if num_iterations > 1:  # the ratio moved far enough for the clip to act on both sides
        assert want["clip_ratio/low_mean"] > 0 and want["clip_ratio/high_mean"] > 0
    else:
        assert want["clip_ratio/region_mean"] == 0


def test_truncated_completions_can_be_left_out_of_the_loss(tokenizer, model):
    task = grpo_task(tokenizer, mask_truncated_completions=True, loss_type="dapo")
    prompts, texts, prompt_batch, completions = fixed_rollout(task, tokenizer, seed=4)
    got = ours(task, model, prompt_batch, completions)
    rewards = [float(i % GROUPS == 1) + 0.5 * -len(ids) / COMPLETION_LENGTH for i, ids in enumerate(texts)]
    want = independent(model, prompts, texts, rewards, "dapo", (0.2, 0.2), 0.0, None, None, True,
                       tokenizer.eos_token_id)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert got["entropy"] == pytest.approx(want["entropy"], abs=1e-5)


def test_advantages_scale_by_batch_or_not_at_all_and_skip_unscorable_completions():
    per_function = torch.tensor([[1.0], [0.0], [1.0], [1.0], [0.5], [0.5], [math.nan], [0.0]])
    batch = grpo_loss.group_advantages(per_function, torch.ones(1), 4, "batch")
    rewards = per_function[:, 0]
    scorable = rewards[~torch.isnan(rewards)]
    group_means = torch.tensor([0.75] * 4 + [scorable[4:].mean().item()] * 4)
    expected = (rewards - group_means) / (scorable.std() + 1e-4)
    assert batch.advantages[6] == 0  # no function applied: no signal
    keep = [0, 1, 2, 3, 4, 5, 7]
    assert batch.advantages[keep].tolist() == pytest.approx(expected[keep].tolist(), abs=1e-6)
    none = grpo_loss.group_advantages(per_function, torch.ones(1), 4, "none")
    assert none.advantages[keep].tolist() == pytest.approx((rewards - group_means)[keep].tolist(), abs=1e-6)
    same = grpo_loss.group_advantages(torch.ones(8, 1), torch.ones(1), 4, "group")
    assert same.std_is_zero.all() and (same.advantages == 0).all()


def test_a_sample_of_completions_goes_to_completions_jsonl_and_the_trackers_with_tables(tokenizer, tmp_path):
    task = grpo_task(tokenizer, num_iterations=2)
    _, texts, prompt_batch, completions = fixed_rollout(task, tokenizer, seed=6)
    tables = []
    tracker = SimpleNamespace(log_table=lambda name, columns, data, step: tables.append((name, columns, data, step)))
    task.accelerator = SimpleNamespace(device=torch.device("cpu"), trackers=[tracker, SimpleNamespace()])
    task.run_dir = tmp_path
    batch = task._completion_batch({k: v[:GROUPS] for k, v in prompt_batch.items()}, Sampled(completions[:GROUPS]))
    rewards = batch.pop("_rewards")
    task._log_completions(batch, rewards, torch.arange(GROUPS, dtype=torch.float32), number=3)
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in rows] == tokenizer.batch_decode(texts[:GROUPS], skip_special_tokens=True)
    assert rows[1]["rewards/exact_match"] == 1.0 and rows[0]["prompt"] == "what is the answer"
    assert [r["step"] for r in rows] == [7] * GROUPS and [r["advantage"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    (name, columns, data, step), = tables
    assert name == "completions" and step == 7 and columns[:3] == ["step", "prompt", "completion"]
    assert [row[2] for row in data] == [r["completion"] for r in rows]


def _resuming(tmp_path, rollout: dict, num_iterations: int = 2):
    """RolloutBatches of a one-rank run with 3 prompt rows and a 10-token vocabulary, resuming `rollout`."""
    from finetune.objectives.rollouts import RolloutBatches

    task = SimpleNamespace(
        cfg=SimpleNamespace(num_iterations=num_iterations, beta=0.0), rows=[{"prompt": "p"}] * 3, run_dir=tmp_path,
        rollout_metrics={}, policy=SimpleNamespace(config=LlamaConfig(vocab_size=10)), restored_batch=lambda b: b,
        accelerator=SimpleNamespace(is_main_process=True, num_processes=1, process_index=0, device="cpu",
                                    unwrap_model=lambda model: model))
    batches = RolloutBatches(SimpleNamespace(load_state_dict=lambda state: None), task)
    batches.load_state_dict({"rollout": {"made": 2, "uses_left": 1, "batches_per_rank": [rollout]}})
    return batches


def test_a_saved_rollout_unlike_any_the_run_made_is_one_line_and_a_cut_line_of_samples_is_dropped(tmp_path):
    whole = {"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 3]], "attention_mask": [[1, 1, 1]],
             "position_ids": [[0, 1, 2]], "advantages": [0.5], "completion_length": [2], "truncated": [0],
             "row": [1], "old_logps": [[0.0, -1.0, -1.0]]}
    samples = tmp_path / "completions.jsonl"
    samples.write_text('{"rollout": 0, "completion": "kept"}\n{"rollout": 2, "completion": "redone"}\n{"rollout": 1, "comp')
    assert len(_resuming(tmp_path, [whole]).buffer) == 1
    assert [json.loads(line)["completion"] for line in samples.read_text().splitlines()] == ["kept"]
    for damage, says in ((lambda b: b.pop("advantages"), "without advantages"),
                         (lambda b: b.update(input_ids=[[1, 2, 99]]), "outside the model's vocabulary of 10"),
                         (lambda b: b.update(input_ids=[[1, 2]]), "shaped \\[1, 2\\]"),
                         (lambda b: b.update(row=[7]), "prompt rows the data does not have"),
                         (lambda b: b.update(input_ids="x"), "its tensors do not load")):
        damaged = copy.deepcopy(whole)
        damage(damaged)
        with pytest.raises(UsageError, match=f"saved rollout is not one the run made \\(.*{says}"):
            _resuming(tmp_path, [damaged])
    with pytest.raises(UsageError, match="no micro-batch"):
        _resuming(tmp_path, [])


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_the_engine_correction_is_trls_truncated_or_masked_importance_ratio(mode):
    """vLLM's correction (TRL's vllm_importance_sampling_mode), written here from
    its definition, each token or sequence on its own; and the loss it weighs."""
    torch.manual_seed(3)
    trainer = -torch.rand(4, 7) * 3
    engine = trainer + torch.randn(4, 7) * 0.6
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[:, :2] = False  # the prompt
    mask[1, 5:] = False  # a completion that ended
    low, high = 0.5, 2.0
    ratio, stats = grpo_loss.engine_importance(trainer, engine, mask, mode, low, high)
    sequence = mode.startswith("sequence")
    for i in range(4):
        positions = [t for t in range(7) if mask[i, t]]
        if sequence:
            values = [math.exp(sum(float(trainer[i, t] - engine[i, t]) for t in positions))]
        else:
            values = [math.exp(float(trainer[i, t] - engine[i, t])) for t in positions]
        if mode.endswith("truncate"):
            values = [min(max(v, low), high) for v in values]
        else:
            values = [v if low <= v <= high else 0.0 for v in values]
        got = ratio[i, :1] if sequence else ratio[i, positions]
        assert got.tolist() == pytest.approx(values, rel=1e-5), (mode, i)
    differences = (trainer - engine).abs()[mask]
    assert float(stats["sampling_logp_difference/max"]) == pytest.approx(float(differences.max()))
    assert float(stats["sampling_logp_difference/mean"]) == pytest.approx(float(differences.mean()))
    kept = ratio.flatten() if sequence else ratio[mask]
    assert float(stats["importance_sampling_ratio/min"]) == float(kept.min())
    # The weight multiplies the policy term; the KL term is added unweighted (TRL's order).
    logps, advantages = trainer.clone(), torch.tensor([1.0, -0.5, 0.25, 2.0])
    reference = trainer - 0.1
    plain = grpo_loss.token_losses(logps, None, advantages, mask, 0.2, 0.2, 0.04, reference)
    weighted = grpo_loss.token_losses(logps, None, advantages, mask, 0.2, 0.2, 0.04, reference, importance=ratio)
    kl = plain.kl
    assert torch.allclose(weighted.losses, (plain.losses - 0.04 * kl) * ratio * mask + 0.04 * kl)
    assert not torch.allclose(weighted.losses, plain.losses)
