"""ORPO's loss and metrics (finetune/objectives/orpo.py) for a fixed batch of
pairs: against a computation written here from the paper's formula with
transformers alone (each sequence scored on its own, unpadded), and against
TRL's ORPOTrainer's first step on the same model and rows."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from finetune.config import TrainConfig
from finetune.data.chat import IGNORE
from finetune.data.preference import PairCollator, PairEncoder
from finetune.objectives.pairs import PreferenceLM
from tests.sft_models import PREFERENCE_WORDS as WORDS, preference_tokenizer, tiny_llama

BETA = 0.25


@pytest.fixture(scope="module")
def tokenizer():
    return preference_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(tokenizer)


def pair_rows(count: int) -> list[dict]:
    rng = random.Random(3)
    return [{"prompt": f"the model {' '.join(rng.choices(WORDS, k=rng.randint(1, 4)))}\n",
             "chosen": " ".join(rng.choices(WORDS[:5], k=rng.randint(1, 5))),
             "rejected": " ".join(rng.choices(WORDS[5:], k=rng.randint(1, 5)))} for _ in range(count)]


@pytest.fixture(scope="module")
def batch(tokenizer) -> dict:
    encoder = PairEncoder(tokenizer)
    rows = [{**encoder.encode(row, i), "pair": i} for i, row in enumerate(pair_rows(4))]
    return PairCollator(tokenizer.pad_token_id)(rows)


def by_hand(model, batch: dict) -> dict[str, float]:
    """Each sequence unpadded through the model: the chosen rows' NLL over all
    their tokens (prompt included), the mean log-probs of each completion, and
    the odds-ratio term, as the ORPO paper writes them."""
    pairs = len(batch["input_ids"]) // 2
    means, nll_sum, nll_tokens = [], 0.0, 0
    for row in range(2 * pairs):
        length = int(batch["attention_mask"][row].sum())
        ids, labels = batch["input_ids"][row, :length], batch["labels"][row, :length]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids[None]).logits[0].double(), dim=-1)
        picked = logprobs[:-1].gather(1, ids[1:, None])[:, 0]
        completion = labels[1:] != IGNORE
        means.append(float(picked[completion].mean()))
        if row < pairs:
            nll_sum, nll_tokens = nll_sum - float(picked.sum()), nll_tokens + len(picked)
    chosen, rejected = means[:pairs], means[pairs:]
    log_odds = [(c - r) - (math.log1p(-math.exp(c)) - math.log1p(-math.exp(r))) for c, r in zip(chosen, rejected)]
    ratios = [-math.log1p(math.exp(-x)) for x in log_odds]
    nll = nll_sum / nll_tokens
    return {"loss": nll - BETA * sum(ratios) / pairs, "nll_loss": nll, "log_odds_ratio": sum(ratios) / pairs,
            "log_odds_chosen": sum(log_odds) / pairs, "rewards/chosen": BETA * sum(chosen) / pairs,
            "rewards/margins": BETA * (sum(chosen) - sum(rejected)) / pairs, "logps/rejected": sum(rejected) / pairs}


def ours(model, batch: dict) -> dict[str, float]:
    task = PreferenceLM(TrainConfig(objective="orpo", dpo_beta=BETA))
    with torch.no_grad():
        out = task.loss(model, batch)
    pairs = len(batch["input_ids"]) // 2
    return {"loss": float(out.total) / pairs, **{name: float(v) / pairs for name, v in out.metrics.items()}}


def test_orpo_loss_and_metrics_equal_the_formula_with_transformers_alone(model, batch):
    expected, got = by_hand(model, batch), ours(model, batch)
    assert expected["log_odds_chosen"] != 0 and expected["nll_loss"] > 0  # an untrained model: real values
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_orpo_first_step_equals_trls_trainer_on_the_same_model_and_data(model, batch, tmp_path, monkeypatch):
    """ORPOTrainer tokenizes, batches and scores the rows itself; its logged
    first-step loss and metrics are ours on the same rows. In fp32 (TRL's
    default is bf16 autocast), and with a tokenizer without a BOS token (as
    Qwen's): TRL's ORPO puts one before every prompt where the tokenizer has
    it, where we encode as the tokenizer does."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tokenizer = preference_tokenizer()
    tokenizer.bos_token = None
    args = ORPOConfig(output_dir=str(tmp_path), beta=BETA, report_to=[], use_cpu=True, bf16=False, max_length=64,
                      per_device_train_batch_size=4, max_steps=1, logging_steps=1, learning_rate=0.0,
                      save_strategy="no", disable_tqdm=True)
    trainer = ORPOTrainer(model=copy.deepcopy(model), args=args, train_dataset=Dataset.from_list(pair_rows(4)),
                          processing_class=tokenizer)
    trainer.train()
    logged, got = trainer.state.log_history[0], ours(model, batch)
    assert logged["loss"] == pytest.approx(got["loss"], rel=1e-5, abs=1e-6)
    for name in ("nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/chosen", "rewards/margins",
                 "logps/rejected"):
        assert logged[name] == pytest.approx(got[name], rel=1e-5, abs=1e-6), name
