"""The documents of the finetune_stdlib_qa task (finetune_stdlib_qa.yaml)."""

from __future__ import annotations

import random

CHOICES = 4


def load(**kwargs):
    """Each held-out question with its answer and three others, in a seeded order."""
    from datasets import Dataset, DatasetDict

    from finetune.data.text import load_raw_data

    raw, _ = load_raw_data("builtin", "chat", "text", 0.05, 42)  # train's defaults: the quickstart's held-out split
    pairs = [(row[0]["content"], row[1]["content"]) for row in raw["validation"]["messages"]]
    rng = random.Random(0)
    docs = []
    for i, (question, answer) in enumerate(pairs):
        others = [pairs[j][1] for j in rng.sample([j for j in range(len(pairs)) if j != i], CHOICES - 1)]
        label = rng.randrange(CHOICES)
        docs.append({"question": question, "choices": others[:label] + [answer] + others[label:], "label": label})
    return DatasetDict({"validation": Dataset.from_list(docs)})
