"""The objectives added beside SFT, DPO and GRPO learn under 2-process FSDP on
CPU, each checked from the outside: ORPO and KTO widen the held-out margin of
chosen (desirable) over rejected log-probabilities, scored from final/ with
transformers alone; RLOO and GSPO raise the held-out reward; a reward model
(full and LoRA) ranks held-out pairs, and GRPO on its scores raises a second
reward that agrees with it. Held-out rewards are of completions sampled from
final/ with transformers alone.
One set of warm runs, side by side, then the GRPO run on the reward model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from conftest import check_ok, launches, read_jsonl, run_cli, run_cli_together, run_in_process, train_rows
from e2e.test_grpo import REWARDS, WORDS
from e2e.test_preference import pairs
from sft_models import save_chat_model, write_jsonl

COMMON = ["--block_size", "64", "--sample_prompt", "", "--log_format", "plain", "--lr_scheduler_type", "constant",
          "--warmup_steps", "0"]


@pytest.fixture(scope="module")
@launches
def runs(tmp_path_factory, env) -> dict:
    """ORPO and KTO on a learnable preference (the GOOD words over the BAD
    ones), RLOO and GRPO with GSPO's ratio on a dense reward, all fp32."""
    root = tmp_path_factory.mktemp("objectives")
    model = save_chat_model(root / "model")
    train, held_out = pairs(96, 0, conversational=True), pairs(24, 1, conversational=True)
    write_jsonl(root / "pairs.jsonl", train)
    unpaired = [{"prompt": row["prompt"], "completion": row[side], "label": side == "chosen"}
                for row in train for side in ("chosen", "rejected")]
    write_jsonl(root / "unpaired.jsonl", unpaired)
    rng = random.Random(0)
    prompts = [{"prompt": [{"role": "user", "content": f"say {' '.join(rng.choices(WORDS, k=rng.randint(2, 5)))}"}]}
               for _ in range(96)]
    write_jsonl(root / "prompts.jsonl", prompts)
    (root / "rewards.py").write_text(REWARDS.replace("answer, **columns", "**columns").replace(
        "    assert len(answer) == len(completions) == len(prompts) == len(completion_ids)\n", ""))
    rollouts = ["--dataset", root / "prompts.jsonl", "--reward_funcs", f"{root / 'rewards.py'}:a_rich",
                "--num_generations", "4", "--per_device_batch_size", "8", "--max_completion_length", "8",
                "--learning_rate", "2e-2", "--max_eval_samples", "16", "--max_steps", "16"]
    preference = ["--per_device_batch_size", "4", "--max_steps", "16"]
    args = {"orpo": ["--method", "orpo", "--dataset", root / "pairs.jsonl", "--learning_rate", "3e-3", *preference],
            "kto": ["--method", "kto", "--dataset", root / "unpaired.jsonl", "--learning_rate", "3e-3",
                    *preference],
            # TRL's RLOO takes a KL of beta 0.05 from the rewards: a reward ten times the share outweighs its noise.
            "rloo": ["--method", "rloo", "--reward_weights", "10", *rollouts],
            "gspo": ["--method", "grpo", "--importance_sampling_level", "sequence", "--loss_type", "grpo",
                     *rollouts]}
    # Reward models of the letter a, on pairs with and without it. The full one is GRPO's reward below, so it learns
    # on what the policy samples at first: 8 of the model's own tokens, 2-5 of them holding an a against none
    # (on words of a-pieces alone, its scores of the policy's samples barely differed). The LoRA one learns words
    # of tokenizer pieces: on the 8-token pairs it ranked 0.4-0.84 over seeds 0-3.
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokens = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    rich, poor = [i for i in tokens if "a" in tokenizer.decode([i])], [i for i in tokens if "a" not in tokenizer.decode([i])]

    def sampled_like(holding_a: int) -> list[dict]:
        ids = rng.choices(rich, k=holding_a) + rng.choices(poor, k=8 - holding_a)
        rng.shuffle(ids)
        return [{"role": "assistant", "content": tokenizer.decode(ids)}]

    rated = [{"prompt": row["prompt"], "chosen": sampled_like(rng.randint(2, 5)), "rejected": sampled_like(0)}
             for row in prompts * 2]
    pieces = [p for p in (tokenizer.decode([i]) for i in range(300)) if p.strip().isalpha()]
    rich_pieces, poor_pieces = [p for p in pieces if "a" in p], [p for p in pieces if "a" not in p]
    worded = [{"prompt": row["prompt"],
               "chosen": [{"role": "assistant", "content": "".join(rng.choices(rich_pieces, k=5))}],
               "rejected": [{"role": "assistant", "content": "".join(rng.choices(poor_pieces, k=5))}]}
              for row in prompts * 2]
    write_jsonl(root / "a-pairs.jsonl", rated[:160])
    write_jsonl(root / "a-words.jsonl", worded[:160])
    # Full: ranked all 32 held-out pairs over seeds 0-6. LoRA: at least 0.94 over seeds 0-7 at 1e-2 for 24 steps.
    args["reward"] = ["--method", "reward", "--dataset", root / "a-pairs.jsonl", "--learning_rate", "1e-2",
                      "--per_device_batch_size", "4", "--max_steps", "32", "--checkpoint_every", "32"]
    args["reward-lora"] = ["--method", "reward", "--peft", "lora", "--dataset", root / "a-words.jsonl",
                           "--learning_rate", "1e-2", "--per_device_batch_size", "4", "--max_steps", "24"]
    dirs = {name: root / name for name in args}
    procs = run_cli_together([(["train", "--model", model, *COMMON, *a, "--output_dir", dirs[name]],
                               {"mixed_precision": "no"}) for name, a in args.items()], env)
    for proc in procs:
        check_ok(proc)
    held_out_prompts = [{"prompt": [{"role": "user", "content": f"say {' '.join(rng.choices(WORDS, k=3))}"}]}
                        for _ in range(16)]
    return {**dirs, "model": model, "held_out": held_out, "root": root, "prompts": root / "prompts.jsonl",
            "held_out_rated": {"reward": rated[160:], "reward-lora": worded[160:]},
            "held_out_prompts": held_out_prompts}


def mean_logps(model, tokenizer, prompt: list[dict], answer: list[dict]) -> float:
    """The answer's mean log-prob after the prompt, through the chat template: transformers alone."""
    context = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = tokenizer.apply_chat_template(prompt + answer, tokenize=True, return_dict=False)
    assert whole[:len(context)] == context
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
    return float(sum(logprobs[t - 1, whole[t]] for t in range(len(context), len(whole))) / (len(whole) - len(context)))


def held_out_margin(model_dir: Path, rows: list[dict]) -> float:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return sum(mean_logps(model, tokenizer, r["prompt"], r["chosen"]) - mean_logps(model, tokenizer, r["prompt"],
                                                                                     r["rejected"])
               for r in rows) / len(rows)


@pytest.mark.parametrize("objective", ["orpo", "kto"])
def test_the_preference_is_learnt_as_transformers_scores_the_final_model(runs, objective):
    run = runs[objective]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["objective"] == objective and summary["distributed_type"] == "FSDP"
    assert len(set(summary["local_params_per_rank"])) == 1 and summary["world_size"] == 2  # sharded in halves
    base, trained = held_out_margin(runs["model"], runs["held_out"]), held_out_margin(run / "final", runs["held_out"])
    assert trained > base + 0.5, (base, trained)  # nats per answer token
    rows = train_rows(run)
    names = {"orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/accuracies"),
             "kto": ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen")}[objective]
    assert all(name in rows[-1] for name in names), rows[-1]
    assert summary["last_eval"]["eval_rewards/margins"] > summary["first_eval"]["eval_rewards/margins"]


@pytest.mark.parametrize("objective", ["rloo", "gspo"])
def test_the_held_out_reward_rises(runs, objective):
    run = runs[objective]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["last_eval"]["reward"] > summary["first_eval"]["reward"], (summary["first_eval"],
                                                                                summary["last_eval"])
    # The run's eval is one greedy completion per prompt: its rise varied (+0.19 to +0.47) with the random model.
    # The sampled share rose +0.08 to +0.35 over 10 random models, from about 0.04.
    base, trained = a_share(runs["model"], runs["held_out_prompts"]), a_share(run / "final", runs["held_out_prompts"])
    assert trained > base + 0.04, (base, trained)
    rows = train_rows(run)
    first, last = (sum(r["reward"] for r in part) / 4 for part in (rows[:4], rows[-4:]))
    assert last > first + 0.1, [round(r["reward"], 3) for r in rows]
    if objective == "rloo":  # TRL's RLOO: a KL term by default, paid from the rewards
        assert summary["objective"] == "rloo" and all("kl" in r for r in rows) and rows[-1]["kl"] != 0
    completions = read_jsonl(run / "completions.jsonl") if (run / "completions.jsonl").exists() else []
    assert completions, "completions.jsonl was written"


def rewards_of(model_dir: Path, rows: list[dict], side: str) -> list[float]:
    """A reward model's scores of each row's prompt and `side`, with transformers alone."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    scores = []
    for row in rows:
        ids = tokenizer.apply_chat_template(row["prompt"] + row[side], tokenize=True, return_dict=False)
        with torch.no_grad():
            scores.append(float(model(torch.tensor([ids])).logits[0, 0]))
    return scores


@pytest.mark.parametrize("name", ["reward", "reward-lora"])
def test_a_reward_model_ranks_held_out_pairs_and_exports_as_a_sequence_classifier(runs, name, tmp_path):
    run = runs[name]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["objective"] == "reward" and summary["task"] == "sequence-classification"
    chosen, rejected = (rewards_of(run / "final", runs["held_out_rated"][name], side) for side in ("chosen", "rejected"))
    accuracy = sum(c > r for c, r in zip(chosen, rejected)) / len(chosen)
    assert accuracy >= 0.9, accuracy  # of 32 held-out pairs
    assert summary["last_eval"]["eval_accuracy"] >= 0.75  # of the 8 pairs the run held out
    config = json.loads((run / "final" / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification")
    assert len(config["id2label"]) == 1  # one score
    if name == "reward":  # the checkpoint exports as final/ is: the same scores
        check_ok(run_in_process("export", run / "checkpoints" / "step_000032", "--output", tmp_path / "exported"))
        assert rewards_of(tmp_path / "exported", runs["held_out_rated"][name][:4], "chosen") == pytest.approx(chosen[:4],
                                                                                                       abs=1e-5)


def a_share(model_dir: Path, prompts: list[dict]) -> float:
    """The mean share of the letter a in 4 sampled completions (8 tokens at
    temperature 1) of each prompt: transformers alone, a fixed torch seed."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(0)
    shares = []
    for row in prompts:
        context = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([context] * 4), do_sample=True, max_new_tokens=8, top_p=1.0, top_k=0,
                                 temperature=1.0, pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, len(context):], skip_special_tokens=True)
        shares += [text.count("a") / max(len(text), 1) for text in texts]
    return sum(shares) / len(shares)


def test_grpo_on_the_reward_model_raises_a_second_reward_that_agrees(runs, env):
    """The reward model's final/ as GRPO's --reward_funcs (no code from it),
    beside the share of the letter a at weight 0, logged and not trained on:
    the policy the model's scores train writes more a's, on held-out prompts
    sampled with transformers alone."""
    run = runs["root"] / "grpo-on-rm"
    check_ok(run_cli(["train", "--model", runs["model"], *COMMON, "--method", "grpo", "--dataset", runs["prompts"],
                      "--reward_funcs", runs["reward"] / "final", f"{runs['root'] / 'rewards.py'}:a_rich",
                      "--reward_weights", "1", "0", "--num_generations", "4", "--per_device_batch_size", "8",
                      "--max_completion_length", "8", "--learning_rate", "2e-2", "--max_eval_samples", "16",
                      "--max_steps", "16", "--output_dir", run], env, mixed_precision="no", warm=True))
    rows = train_rows(run)
    assert all(row["frac_reward_zero_std"] < 1 for row in rows)  # the model's scores differ within a group
    assert all(row["reward"] == pytest.approx(row["rewards/final/mean"], abs=1e-5) for row in rows)  # a weight of 0
    first, last = (sum(r["rewards/a_rich/mean"] for r in part) / 4 for part in (rows[:4], rows[-4:]))
    assert last > 2 * first, [round(r["rewards/a_rich/mean"], 3) for r in rows]
    base, trained = a_share(runs["model"], runs["held_out_prompts"]), a_share(run / "final", runs["held_out_prompts"])
    assert trained > base + 0.05, (base, trained)  # +0.12 to +0.21 over 4 random models
    sampled = read_jsonl(run / "completions.jsonl")[0]
    assert isinstance(sampled["rewards/final"], float) and sampled["rewards/final"] != 0
