"""KTO's data, loss and metrics (finetune/objectives/kto.py, unpaired.py and
data/unpaired.py) for a fixed batch of labelled completions: against a
computation written here from the paper's formula with transformers alone
(each sequence scored on its own, unpadded), and against TRL's KTOTrainer's
first step on the same policy, reference and rows."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from datasets import Dataset, DatasetDict

from finetune.config import TrainConfig
from finetune.data.chat import IGNORE
from finetune.data.unpaired import UnpairedCollator, UnpairedEncoder, build_unpaired_splits
from finetune.errors import UsageError
from finetune.objectives.unpaired import UnpairedLM
from tests.sft_models import PREFERENCE_WORDS as WORDS, preference_tokenizer, tiny_llama

BETA, DESIRABLE, UNDESIRABLE = 0.5, 1.0, 1.5


@pytest.fixture(scope="module")
def tokenizer():
    return preference_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    """The policy, and a reference of other weights (a real KL term and real rewards)."""
    policy = tiny_llama(tokenizer)
    reference = copy.deepcopy(policy)
    generator = torch.Generator().manual_seed(3)  # a reference the policy's KL from is above 0
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.3 * p.std().clamp(min=1e-3))
    return policy, reference


def unpaired_rows(count: int) -> list[dict]:
    rng = random.Random(5)
    rows = []
    for i in range(count):
        good = i % 3 != 0
        words = WORDS[:5] if good else WORDS[5:]
        rows.append({"prompt": f"the model {' '.join(rng.choices(WORDS, k=rng.randint(1, 4)))}\n",
                     "completion": " ".join(rng.choices(words, k=rng.randint(1, 5))), "label": good})
    return rows


@pytest.fixture(scope="module")
def batch(tokenizer) -> dict:
    encoder = UnpairedEncoder(tokenizer)
    return UnpairedCollator(tokenizer.pad_token_id, 64)([encoder.encode(row, i) for i, row in enumerate(unpaired_rows(6))])


def summed_logps(model, ids: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids[None]).logits[0].double(), dim=-1)
    picked = logprobs[:-1].gather(1, ids[1:, None])[:, 0]
    return float(picked[labels[1:] != IGNORE].sum())


def by_hand(models, batch: dict) -> dict[str, float]:
    """The KTO paper's loss, each sequence unpadded through each model: the KL
    estimate from the mismatched rows (the second half of the batch)."""
    policy, reference = models
    n = len(batch["label"])

    def scores(model, row):
        length = int(batch["attention_mask"][row].sum())
        return summed_logps(model, batch["input_ids"][row, :length], batch["labels"][row, :length])

    kl = max(0.0, sum(scores(policy, n + i) - scores(reference, n + i) for i in range(n)) / n)
    losses, rewards = [], {True: [], False: []}
    for i, good in enumerate(batch["label"].tolist()):
        r = BETA * (scores(policy, i) - scores(reference, i))
        rewards[good].append(r)
        z = BETA * kl
        losses.append(DESIRABLE * (1 - 1 / (1 + math.exp(-(r - z)))) if good
                      else UNDESIRABLE * (1 - 1 / (1 + math.exp(-(z - r)))))
    chosen, rejected = sum(rewards[True]) / len(rewards[True]), sum(rewards[False]) / len(rewards[False])
    return {"loss": sum(losses) / n, "kl": kl, "rewards/chosen": chosen, "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected}


def ours(models, batch: dict) -> dict[str, float]:
    policy, reference = models
    task = UnpairedLM(TrainConfig(objective="kto", dpo_beta=BETA, desirable_weight=DESIRABLE,
                                  undesirable_weight=UNDESIRABLE, per_device_batch_size=6))
    task.reference = reference
    with torch.no_grad():
        out = task.loss(policy, batch)
    n = len(batch["label"])
    return {"loss": float(out.total) / n, **task.step_means({k: float(v) for k, v in out.metrics.items()}, n)}


def test_the_mismatched_rows_pair_each_prompt_with_the_completion_before_it(batch):
    n = len(batch["label"])
    for i in range(n):
        j = (i - 1) % n
        completion = batch["labels"][j][batch["labels"][j] != IGNORE].tolist()
        mismatched = batch["labels"][n + i][batch["labels"][n + i] != IGNORE].tolist()
        assert mismatched == completion
        prompt = int((batch["labels"][i] != IGNORE).nonzero()[0])  # where row i's completion starts
        assert torch.equal(batch["input_ids"][n + i, :prompt], batch["input_ids"][i, :prompt])


def test_kto_loss_and_metrics_equal_the_formula_with_transformers_alone(models, batch):
    expected, got = by_hand(models, batch), ours(models, batch)
    assert expected["kl"] > 0 and expected["rewards/margins"] != 0  # other weights: a real KL term
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name


def test_kto_first_step_equals_trls_trainer_on_the_same_models_and_data(models, tokenizer, batch, tmp_path):
    """KTOTrainer tokenizes the rows, pairs its mismatched completions and
    scores them itself; its logged first-step loss and metrics are ours on the
    same rows (one batch of all six: the same mismatched set). In fp32: TRL's
    default is bf16 autocast."""
    from trl import KTOConfig, KTOTrainer

    policy, reference = models
    args = KTOConfig(output_dir=str(tmp_path), beta=BETA, desirable_weight=DESIRABLE,
                     undesirable_weight=UNDESIRABLE, report_to=[], use_cpu=True, bf16=False, max_length=64,
                     per_device_train_batch_size=6, max_steps=1, logging_steps=1, learning_rate=0.0,
                     save_strategy="no", disable_tqdm=True)
    trainer = KTOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                         train_dataset=Dataset.from_list(unpaired_rows(6)), processing_class=tokenizer)
    trainer.train()
    logged, got = trainer.state.log_history[0], ours(models, batch)
    assert logged["loss"] == pytest.approx(got["loss"], rel=1e-5, abs=1e-5)
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert logged[name] == pytest.approx(got[name], rel=1e-5, abs=1e-5), name


def test_unpaired_data_without_both_labels_or_with_other_labels_is_refused(tokenizer):
    rows = unpaired_rows(6)
    one_class = DatasetDict(train=Dataset.from_list([{**row, "label": True} for row in rows]))
    with pytest.raises(UsageError, match="every training completion is desirable"):
        build_unpaired_splits(one_class, tokenizer, 64, 0, "truncate")
    numbered = [{**row, "label": int(row["label"])} for row in rows]
    with pytest.raises(UsageError, match="example 1: label must be true .* or false"):
        build_unpaired_splits(DatasetDict(train=Dataset.from_list(numbered)), tokenizer, 64, 0, "truncate")
    with pytest.raises(UsageError, match="two strings or two lists of messages"):
        UnpairedEncoder(tokenizer).encode({**rows[0], "completion": [{"role": "assistant", "content": "x"}]}, 0)
