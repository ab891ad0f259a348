"""The reward model's loss and metrics (finetune/objectives/reward_model.py and
scored_pairs.py) for a fixed batch of pairs with margins: against the
formula with transformers alone (each sequence scored on its own, unpadded),
and against TRL's RewardTrainer's first step on the same model and rows; and a reward
model's dir as a GRPO reward (objectives/rewards.py)."""

from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from finetune.config import TrainConfig, load_config
from finetune.data.preference import PairCollator, PairEncoder
from finetune.errors import UsageError
from finetune.objectives.rewards import check_reward_files, load_reward_functions, score
from finetune.objectives.scored_pairs import RewardModel
from tests.sft_models import PREFERENCE_WORDS as WORDS, preference_tokenizer, save_chat_model

CENTER = 0.01


@pytest.fixture(scope="module")
def tokenizer():
    return preference_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForSequenceClassification(config).eval()
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # scores far enough apart to rank pairs either way
    return model


def pair_rows(count: int) -> list[dict]:
    rng = random.Random(7)
    return [{"prompt": f"the model {' '.join(rng.choices(WORDS, k=rng.randint(1, 4)))}\n",
             "chosen": " ".join(rng.choices(WORDS[:5], k=rng.randint(1, 5))),
             "rejected": " ".join(rng.choices(WORDS[5:], k=rng.randint(1, 5))), "margin": 0.5 * i}
            for i in range(count)]


@pytest.fixture(scope="module")
def batch(tokenizer) -> dict:
    encoder = PairEncoder(tokenizer)
    return PairCollator(tokenizer.pad_token_id)([{**encoder.encode(row, i), "pair": i}
                                                 for i, row in enumerate(pair_rows(4))])


def by_hand(model, batch: dict) -> dict[str, float]:
    pairs = len(batch["input_ids"]) // 2
    scores = []
    for row in range(2 * pairs):
        length = int(batch["attention_mask"][row].sum())
        with torch.no_grad():
            scores.append(float(model(batch["input_ids"][row, :length][None]).logits[0, 0]))
    chosen, rejected = scores[:pairs], scores[pairs:]
    margins = batch["margin"].tolist()
    losses = [math.log1p(math.exp(-(c - r - m))) + CENTER * (c + r) ** 2 for c, r, m in zip(chosen, rejected, margins)]
    return {"loss": sum(losses) / pairs, "accuracy": sum(c > r for c, r in zip(chosen, rejected)) / pairs,
            "margin": sum(c - r for c, r in zip(chosen, rejected)) / pairs}


def ours(model, batch: dict) -> dict[str, float]:
    task = RewardModel(TrainConfig(objective="reward", task="sequence-classification", model="x",
                                   center_rewards_coefficient=CENTER))
    with torch.no_grad():
        out = task.loss(model, batch)
    pairs = len(batch["input_ids"]) // 2
    return {"loss": float(out.total) / pairs, **{name: float(v) / pairs for name, v in out.metrics.items()}}


def test_reward_loss_and_metrics_equal_the_formula_with_transformers_alone(model, batch):
    expected, got = by_hand(model, batch), ours(model, batch)
    assert 0 < expected["accuracy"] < 1  # some pairs each way: a real comparison
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name


def test_reward_first_step_equals_trls_trainer_on_the_same_model_and_data(model, tokenizer, batch, tmp_path):
    """RewardTrainer tokenizes, batches and scores the rows itself; its logged
    first-step loss, accuracy and margin are ours on the same rows. In fp32:
    TRL's default is bf16 autocast."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(tmp_path), center_rewards_coefficient=CENTER, report_to=[], use_cpu=True,
                        bf16=False, max_length=64, per_device_train_batch_size=4, max_steps=1, logging_steps=1,
                        learning_rate=0.0, save_strategy="no", disable_tqdm=True)
    trainer = RewardTrainer(model=copy.deepcopy(model), args=args, train_dataset=Dataset.from_list(pair_rows(4)),
                            processing_class=tokenizer)
    trainer.train()
    logged, got = trainer.state.log_history[0], ours(model, batch)
    assert logged["loss"] == pytest.approx(got["loss"], rel=1e-5, abs=1e-5)
    assert logged["accuracy"] == pytest.approx(got["accuracy"])
    assert logged["margin"] == pytest.approx(got["margin"], rel=1e-5, abs=1e-5)


def test_a_reward_models_dir_scores_completions_and_a_causal_lm_is_refused(model, tokenizer, tmp_path):
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    [reward] = load_reward_functions([str(tmp_path / "rm")], "", 8)
    assert reward.name == "rm" and not reward.user_code  # its weights only: no code of its own runs
    prompts, completions = ["the model reads\n", "the model\n"], ["sorted returns", "error disk"]
    got = [row[0] for row in score([reward], prompts, completions, [[1], [2]], {})]
    with torch.no_grad():
        want = [float(model(tokenizer(p + c, return_tensors="pt", add_special_tokens=False)["input_ids"]).logits[0, 0])
                for p, c in zip(prompts, completions)]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    causal = save_chat_model(tmp_path / "causal")
    with pytest.raises(UsageError, match="is a model dir of LlamaForCausalLM, not a reward model"):
        check_reward_files([str(causal)])
    with pytest.raises(UsageError, match="--method reward puts a score head on a pretrained language model"):
        load_config(None, {"method": "reward"})  # the tiny-gpt2 preset
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
