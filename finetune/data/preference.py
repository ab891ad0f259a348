"""Preference pairs for DPO and SimPO, in TRL's formats (detected from the columns):

- standard: `prompt`, `chosen`, `rejected` as strings;
- conversational: `prompt` a list of messages, `chosen` / `rejected` lists of
  assistant messages;
- implicit prompt: no `prompt`; `chosen` / `rejected` whole conversations
  whose shared leading messages are the prompt.

Each side becomes one sequence, prompt then completion, rendered as SFT renders
it (chat/chat_template for messages, plain text plus the end-of-text token for
strings) with labels on the completion only: its answers and their end-of-turn
tokens. A training row holds both sides; `PairCollator` stacks a batch's chosen
sequences, then its rejected ones, for one forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset, DatasetDict
from transformers import PreTrainedTokenizerBase

from finetune.data.chat import (EXAMPLE_NUMBER, IGNORE, ChatEncoder, Encoded, PadCollator, check_messages, counted,
                                 well_formed_messages)
from finetune.errors import UsageError

SIDES = ("chosen", "rejected")


@dataclass
class PairStats:
    pairs: int = 0
    truncated: int = 0
    dropped_long_prompt: int = 0
    dropped_long: int = 0
    dropped_no_target: int = 0

    def describe(self) -> str:
        return counted(f"{self.pairs} pairs", {"truncated": self.truncated,
                                                "with a prompt over --max_prompt_length dropped": self.dropped_long_prompt,
                                                "longer than --block_size dropped": self.dropped_long,
                                                "dropped with no completion token left": self.dropped_no_target})


def _nonempty_string(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def split_pair(row: dict, where: str) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected): three strings, or a list of messages and two
    lists of completion messages. Refuses a row that is neither, names it."""
    prompt, chosen, rejected = row.get("prompt"), row.get("chosen"), row.get("rejected")
    if all(isinstance(v, str) for v in (chosen, rejected)):
        if prompt is not None and not isinstance(prompt, str):
            raise UsageError(f"{where}: with string chosen and rejected, the prompt must be a string too, got "
                             f"{type(prompt).__name__}; or give chosen and rejected as lists of messages")
        if not all(_nonempty_string(v) for v in (prompt, chosen, rejected)):
            empty = [name for name, v in (("prompt", prompt), *zip(SIDES, (chosen, rejected)))
                     if not _nonempty_string(v)]
            raise UsageError(f"{where}: {' and '.join(empty)} must be non-empty strings; fix that pair or drop it")
    elif prompt is None:  # implicit prompt: the conversations' shared leading messages
        chosen, rejected = (check_messages(side, f"{where} ({name})") for name, side in zip(SIDES, (chosen, rejected)))
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not prompt or not chosen or not rejected:
            raise UsageError(f"{where}: chosen and rejected share no leading prompt message, or one of them is "
                             "nothing but that prompt; give the pair a prompt column, or fix it")
    elif isinstance(prompt, str):  # then both sides must be strings too: one of them is not
        kinds = " and ".join(f"{name} {type(side).__name__ if side is not None else 'missing'}"
                             for name, side in zip(SIDES, (chosen, rejected)))
        raise UsageError(f"{where}: with a string prompt, chosen and rejected must be strings too, got {kinds}; "
                         "fix that pair")
    else:
        if not isinstance(prompt, list) or not prompt:
            raise UsageError(f"{where}: the prompt must be a string or a non-empty list of messages, got "
                             f"{repr(prompt)[:60]}; fix that pair")
        prompt = well_formed_messages(prompt, where)
        chosen, rejected = (check_messages(side, f"{where} ({name})") if isinstance(side, list) else side
                            for name, side in zip(SIDES, (chosen, rejected)))
        if not all(isinstance(side, list) for side in (chosen, rejected)):
            raise UsageError(f"{where}: with a prompt of messages, chosen and rejected must be lists of messages; "
                             "fix that pair")
    if chosen == rejected:
        raise UsageError(f"{where}: chosen and rejected are the same, so there is no preference to learn; fix that "
                         "pair or drop it")
    return prompt, chosen, rejected


class PairEncoder:
    """Token ids and completion labels of each side of a pair."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.messages = ChatEncoder(tokenizer, "chat", train_on_prompt=False)
        self.strings = ChatEncoder(tokenizer, "prompt_completion", train_on_prompt=False)

    def encode(self, row: dict, index: int) -> dict[str, list[int]]:
        where = f"example {row.get(EXAMPLE_NUMBER, index + 1)}"
        prompt, chosen, rejected = split_pair(row, where)
        out = {}
        for name, completion in zip(SIDES, (chosen, rejected)):
            encoded = self.encode_side(prompt, completion, index, where)
            out[f"{name}_input_ids"], out[f"{name}_labels"] = encoded.input_ids, encoded.labels
        if "margin" in row:  # by how much chosen should win, where the data says (TRL's reward-model column)
            margin = row["margin"]
            if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
                raise UsageError(f"{where}: margin must be a number, got {margin!r}; fix that pair")
            out["margin"] = float(margin)
        return out

    def encode_side(self, prompt, completion, index: int, where: str) -> Encoded:
        """One sequence, the prompt then the completion, labelled on the completion."""
        if isinstance(prompt, str):
            return self.strings.encode({"prompt": prompt, "completion": completion, EXAMPLE_NUMBER: index + 1}, index)
        return self.messages.encode_messages(prompt + completion, where,
                                             first_answer=sum(m["role"] == "assistant" for m in prompt))


def prompt_length(labels: list[int]) -> int:
    return next((i for i, label in enumerate(labels) if label != IGNORE), len(labels))


def fit_pair(pair: dict, block_size: int, max_prompt_length: int, long_examples: str, stats: PairStats) -> dict | None:
    """The pair cut to `block_size` (or None, counted, when it is dropped)."""
    if max_prompt_length and max(prompt_length(pair[f"{s}_labels"]) for s in SIDES) > max_prompt_length:
        stats.dropped_long_prompt += 1
        return None
    if max(len(pair[f"{s}_input_ids"]) for s in SIDES) > block_size:
        if long_examples == "drop":
            stats.dropped_long += 1
            return None
        pair = {key: value[:block_size] if isinstance(value, list) else value for key, value in pair.items()}
        stats.truncated += 1
    if any(all(label == IGNORE for label in pair[f"{s}_labels"][1:]) for s in SIDES):
        stats.dropped_no_target += 1
        return None
    return pair


def encoded_rows(split: Dataset, encoder, desc: str, num_proc: int = 0) -> Dataset:
    """`encoder.encode(row, index)` of every row (a dict of token lists), through datasets' map."""
    def encode(batch, indices):
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        encoded = [encoder.encode(row, i) for row, i in zip(rows, indices)]
        return {key: [e[key] for e in encoded] for key in encoded[0]} if encoded else {}

    return split.map(encode, batched=True, with_indices=True, remove_columns=split.column_names, desc=desc,
                     num_proc=num_proc or None)


def build_pair_splits(raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, block_size: int, max_prompt_length: int,
                      long_examples: str, num_proc: int = 0) -> tuple[DatasetDict, str]:
    """A row per pair for every split, and a one-line description of them."""
    encoder = PairEncoder(tokenizer)
    out, notes, numbered = {}, [], 0
    for name, split in raw.items():
        tokens = encoded_rows(split, encoder, f"rendering {name} preference pairs", num_proc)
        stats = PairStats()
        kept = [pair for row in tokens
                if (pair := fit_pair(row, block_size, max_prompt_length, long_examples, stats)) is not None]
        stats.pairs = len(kept)
        if not kept:
            raise UsageError(f"no {name} pair is left after fitting to --block_size {block_size} "
                             f"({stats.describe()}); raise --block_size (or --max_prompt_length)")
        # Each pair's number across the splits: where its precomputed reference log-probs are.
        out[name] = Dataset.from_list([{**pair, "pair": numbered + i} for i, pair in enumerate(kept)])
        numbered += len(kept)
        notes.append(f"{name}: {stats.describe()}")
    return DatasetDict(out), "; ".join(notes)


class PairCollator:
    """A batch of B pairs as 2B padded sequences: the chosen sides, then the rejected."""

    def __init__(self, pad_id: int):
        self.pad = PadCollator(pad_id)

    def __call__(self, pairs: list[dict]) -> dict[str, torch.Tensor]:
        rows = [{"input_ids": pair[f"{side}_input_ids"], "labels": pair[f"{side}_labels"],
                 "position_ids": list(range(len(pair[f"{side}_input_ids"])))}
                for side in SIDES for pair in pairs]
        margins = {"margin": torch.tensor([pair["margin"] for pair in pairs])} if "margin" in pairs[0] else {}
        return {**self.pad(rows), "pair": torch.tensor([pair["pair"] for pair in pairs]), **margins}
