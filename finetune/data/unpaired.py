"""Unpaired completions for KTO, in TRL's format: `prompt`, `completion` and a
boolean `label` (true: desirable), the prompt and completion as strings or as
messages (a prompt of messages, a completion of assistant messages).

Each row becomes one sequence, prompt then completion, rendered as preference
pairs render a side (data/preference.py), labelled on the completion. The
collator also builds each micro-batch's mismatched rows, TRL's estimate of the
KL term: the i-th prompt with the completion of the row before it (the first
prompt with the last completion), the same set of completions under other prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from datasets import Dataset, DatasetDict
from transformers import PreTrainedTokenizerBase

from finetune.data.chat import EXAMPLE_NUMBER, IGNORE, PadCollator, check_messages, counted, well_formed_messages
from finetune.data.preference import PairEncoder, encoded_rows, prompt_length
from finetune.errors import UsageError


@dataclass
class UnpairedStats:
    rows: int = 0
    desirable: int = 0
    truncated: int = 0
    dropped_long_prompt: int = 0
    dropped_long: int = 0
    dropped_no_target: int = 0

    def describe(self) -> str:
        return counted(f"{self.rows} completions ({self.desirable} desirable, {self.rows - self.desirable} "
                       "undesirable)", {"truncated": self.truncated,
                                        "with a prompt over --max_prompt_length dropped": self.dropped_long_prompt,
                                        "longer than --block_size dropped": self.dropped_long,
                                        "dropped with no completion token left": self.dropped_no_target})


def split_unpaired(row: dict, where: str) -> tuple[object, object, bool]:
    """(prompt, completion, label): two strings, or a list of messages and a list
    of completion messages; the label a bool. Refuses a row that is neither, names it."""
    prompt, completion, label = row.get("prompt"), row.get("completion"), row.get("label")
    if not isinstance(label, bool):
        raise UsageError(f"{where}: label must be true (a desirable completion) or false (an undesirable one), got "
                         f"{label!r}; fix that row")
    if isinstance(prompt, str) and isinstance(completion, str):
        if not (prompt.strip() and completion.strip()):
            raise UsageError(f"{where}: prompt and completion must be non-empty strings; fix that row or drop it")
        return prompt, completion, label
    if isinstance(prompt, list) and isinstance(completion, list):
        return well_formed_messages(prompt, where), check_messages(completion, f"{where} (completion)"), label
    raise UsageError(f"{where}: prompt and completion must be two strings or two lists of messages, got "
                     f"{type(prompt).__name__} and {type(completion).__name__}; fix that row")


class UnpairedEncoder:
    """Token ids and completion labels of a row, and its label."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.pairs = PairEncoder(tokenizer)

    def encode(self, row: dict, index: int) -> dict:
        where = f"example {row.get(EXAMPLE_NUMBER, index + 1)}"
        prompt, completion, label = split_unpaired(row, where)
        encoded = self.pairs.encode_side(prompt, completion, index, where)
        return {"input_ids": encoded.input_ids, "labels": encoded.labels, "label": label}


def fit_row(row: dict, block_size: int, max_prompt_length: int, long_examples: str,
            stats: UnpairedStats) -> dict | None:
    """The row cut to `block_size` (or None, counted, when it is dropped)."""
    if max_prompt_length and prompt_length(row["labels"]) > max_prompt_length:
        stats.dropped_long_prompt += 1
        return None
    if len(row["input_ids"]) > block_size:
        if long_examples == "drop":
            stats.dropped_long += 1
            return None
        row = {**row, "input_ids": row["input_ids"][:block_size], "labels": row["labels"][:block_size]}
        stats.truncated += 1
    if all(label == IGNORE for label in row["labels"][1:]):
        stats.dropped_no_target += 1
        return None
    return row


def build_unpaired_splits(raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, block_size: int,
                          max_prompt_length: int, long_examples: str, num_proc: int = 0) -> tuple[DatasetDict, str]:
    """A row per completion for every split, and a one-line description of them.
    The training split needs desirable and undesirable completions both."""
    encoder = UnpairedEncoder(tokenizer)
    out, notes = {}, []
    for name, split in raw.items():
        tokens = encoded_rows(split, encoder, f"rendering {name} completions", num_proc)
        stats = UnpairedStats()
        kept = [fitted for row in tokens
                if (fitted := fit_row(row, block_size, max_prompt_length, long_examples, stats)) is not None]
        stats.rows, stats.desirable = len(kept), sum(row["label"] for row in kept)
        if not kept:
            raise UsageError(f"no {name} completion is left after fitting to --block_size {block_size} "
                             f"({stats.describe()}); raise --block_size (or --max_prompt_length)")
        if name == "train" and stats.desirable in (0, stats.rows):
            held = "desirable (label true)" if stats.desirable else "undesirable (label false)"
            raise UsageError(f"every training completion is {held}: KTO learns from the contrast of desirable and "
                             "undesirable completions; add rows of the other label (or train on the desirable ones "
                             "with --method sft)")
        out[name] = Dataset.from_list(kept)
        notes.append(f"{name}: {stats.describe()}")
    return DatasetDict(out), "; ".join(notes)


class UnpairedCollator:
    """A batch of B rows as 2B padded sequences: the rows, then the mismatched
    rows (row i's prompt with row i-1's completion), and each row's label."""

    def __init__(self, pad_id: int, block_size: int):
        self.pad, self.block_size = PadCollator(pad_id), block_size

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        parts = [(row["input_ids"][:(cut := prompt_length(row["labels"]))], row["input_ids"][cut:],
                  row["labels"][cut:]) for row in rows]
        mismatched = []
        for (prompt, _, _), (_, completion, labels) in zip(parts, parts[-1:] + parts[:-1]):
            room = max(1, self.block_size - len(prompt))  # cut as the rows were: to --block_size
            mismatched.append((prompt, completion[:room], labels[:room]))
        sequences = [{"input_ids": prompt + completion, "labels": [IGNORE] * len(prompt) + labels,
                      "position_ids": list(range(len(prompt) + len(completion)))}
                     for prompt, completion, labels in parts + mismatched]
        return {**self.pad(sequences), "label": torch.tensor([bool(row["label"]) for row in rows])}
