"""Instruction and chat data for supervised fine-tuning (SFT).

Rows come in one of three formats (detected from the columns, or named with
--data_format): `messages` (chat), `instruction`/`input`/`output` (Alpaca) or
`prompt`/`completion`. Each becomes token ids and labels: the label is the
token id where the loss is taken, -100 elsewhere. By default the loss is taken
on the assistant's answers and the end-of-turn token that closes each of them,
so the model learns to stop.

Which tokens are the answers is found from the rendered text, not from the
template's `{% generation %}` tags (most templates have none): the
conversation is rendered up to each assistant turn with the generation prompt,
and up to the end of that turn; the answer is what the turn adds, from its
content up to the first special token after it (the end-of-turn token). Token
offsets then map those character spans onto tokens.

Examples are then packed into blocks of `block_size` tokens (position ids
restart at 0 for each example, and the attention mask built from them keeps
examples apart; see `causal_lm.attention_inputs`) or kept one per row and
padded per batch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, DatasetDict
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from finetune.data.formats import FORMATS
from finetune.data.templates import check_chat_template
from finetune.errors import UsageError, not_a_file

IGNORE = -100
ROLES = ("system", "user", "assistant", "tool")
# Each example's 1-based number in its source split, kept through the held-out
# split's shuffle so that errors name the example the user can find.
EXAMPLE_NUMBER = "_example"


def detect_format(columns: list[str], requested: str, text_column: str, dataset: str, objective: str = "sft") -> str:
    """The data format: the one requested, checked against the columns, or the
    first whose columns are all present. `objective`: the --method that asked
    for its own format, named in the error when the columns are not there."""
    have = ", ".join(columns)
    if requested == "auto":
        found = next((name for name, entry in FORMATS.items() if set(entry.columns) <= set(columns)), None)
        if found:
            return found
        if text_column in columns:
            return "text"
        kinds = ", ".join(f"{name} ({'/'.join(entry.columns)})" for name, entry in FORMATS.items())
        raise UsageError(f"--dataset {dataset} has no column {text_column!r} (columns: {have}), nor those of the "
                         f"formats {kinds}; pass --text_column with the right name, or rename the columns")
    entry = FORMATS.get(requested)
    needed = entry.columns if entry else (text_column,)
    missing = [c for c in needed if c not in columns]
    if missing and entry and not entry.sft:
        raise UsageError(f"--method {objective} trains on {entry.words}, and --dataset {dataset} has no column(s) "
                         f"{', '.join(missing)} (columns: {have}); give each row {entry.example}, renaming the "
                         "columns, or train on it with --method sft")
    if missing:
        try:
            fix = f"pass --data_format {detect_format(columns, 'auto', text_column, dataset)}"
        except UsageError:
            fix = "rename the columns"
        raise UsageError(f"--data_format {requested} needs the column(s) {', '.join(missing)}, but --dataset {dataset} "
                         f"has {have}; {fix}")
    return requested


# --- rows -> conversations ------------------------------------------------------------------------

def check_messages(messages: Any, where: str) -> list[dict]:
    """A list of {role, content} with known roles and at least one assistant turn."""
    messages = well_formed_messages(messages, where)
    if not any(m["role"] == "assistant" for m in messages):
        raise UsageError(f"{where}: the conversation has no assistant turn, so there is nothing to learn; "
                         "add the assistant's answer or drop the row")
    return messages


def well_formed_messages(messages: Any, where: str) -> list[dict]:
    """A non-empty list of {role, content} with known roles, no tool calls and no empty answer."""
    if isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(
            isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for m in messages):
        raise UsageError(f"{where}: its messages show images, which a model of text alone cannot read; train a "
                         "vision-language model on them with --task image-text-to-text")
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages)):
        shown = repr(messages)[:80]
        raise UsageError(f"{where}: messages must be a non-empty list of {{\"role\": ..., \"content\": ...}} with "
                         f"string values, got {shown}; fix that row of the data")
    unknown = sorted({m["role"] for m in messages} - set(ROLES))
    if unknown:
        raise UsageError(f"{where}: unknown role(s) {', '.join(map(repr, unknown))} in messages; use "
                         f"{', '.join(ROLES)}")
    if any(m.get("tool_calls") for m in messages):
        # Only role and content are rendered: the call would be learnt as an empty answer.
        raise UsageError(f"{where}: an assistant turn calls tools (tool_calls), and finetune trains on text answers "
                         "only; drop the tool turns from that example, or write the call into the turn's content")
    if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
        raise UsageError(f"{where}: an assistant turn is empty, so there is nothing to learn from it; write the "
                         "answer or drop that turn")
    # The reasoning fields the reasoning templates render (Qwen3's reasoning_content, gpt-oss's thinking) stay.
    return [{"role": m["role"], "content": m["content"],
             **{key: m[key] for key in REASONING_FIELDS if isinstance(m.get(key), str) and m[key]}} for m in messages]


def instruction_messages(row: dict, where: str) -> list[dict]:
    instruction, output, extra = row.get("instruction"), row.get("output"), row.get("input")
    if not isinstance(instruction, str) or not isinstance(output, str) or not (extra is None or isinstance(extra, str)):
        raise UsageError(f"{where}: instruction, input and output must be strings; fix that row of the data")
    user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


# --- conversations -> token ids and labels --------------------------------------------------------

@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]


class ChatEncoder:
    """Renders rows with the tokenizer's chat template and labels the tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, data_format: str, train_on_prompt: bool,
                 train_on_reasoning: bool = True):
        if not tokenizer.is_fast:
            raise UsageError("SFT data needs a fast tokenizer (for token offsets); save the model's tokenizer.json "
                             "with it")
        self.tokenizer = tokenizer
        self.data_format = data_format
        self.train_on_prompt = train_on_prompt
        self.train_on_reasoning = train_on_reasoning
        self.special_tokens = sorted({t for t in tokenizer.all_special_tokens}
                                     | {t.content for t in tokenizer.added_tokens_decoder.values() if t.special},
                                     key=len, reverse=True)

    def encode(self, row: dict, index: int) -> Encoded:
        where = f"example {row.get(EXAMPLE_NUMBER, index + 1)}"
        if self.data_format != "prompt_completion":
            messages = check_messages(row["messages"], where) if self.data_format == "chat" \
                else instruction_messages(row, where)
            return self.encode_messages(messages, where)
        text, spans = self._prompt_completion(row, where)
        return self._labelled(text, spans, add_special=True)  # plain text, tokenized as the text format tokenizes it

    def encode_messages(self, messages: list[dict], where: str, first_answer: int = 0) -> Encoded:
        """Labels on the assistant turns from the `first_answer`-th on (a
        preference pair's completion follows a prompt that may hold answers)."""
        text, spans = self.render(messages, where)
        return self._labelled(text, spans[first_answer:], add_special=False)  # the template writes BOS and scaffolding

    def _labelled(self, text: str, spans: list[tuple[int, int]], add_special: bool) -> Encoded:
        enc = self.tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
        ids = enc["input_ids"]
        if self.data_format == "prompt_completion":
            ids = ids + [self.tokenizer.eos_token_id]
            offsets = enc["offset_mapping"] + [(len(text), len(text) + 1)]
            spans = [(spans[0][0], len(text) + 1)]
        else:
            offsets = enc["offset_mapping"]
        if self.train_on_prompt:
            return Encoded(ids, list(ids))
        labels = [tok if any(start <= begin < end for start, end in spans) and stop > begin else IGNORE
                  for tok, (begin, stop) in zip(ids, offsets)]
        return Encoded(ids, labels)

    def _prompt_completion(self, row: dict, where: str) -> tuple[str, list[tuple[int, int]]]:
        prompt, completion = row.get("prompt"), row.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise UsageError(f"{where}: prompt and completion must be strings; fix that row of the data")
        return prompt + completion, [(len(prompt), len(prompt) + len(completion))]

    def render(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation as text, and the character spans of the answers.

        An answer's span is found by rendering the conversation up to it: it
        starts where the generation prompt ends. Reasoning templates (Qwen3,
        gpt-oss) render an earlier turn's reasoning only while it is the last
        turn: there the whole conversation is not the turns rendered one by
        one, and such a turn's answer is found in it by its text instead."""
        full = self._apply(messages, False, where)
        if self.train_on_prompt:
            return full, []
        spans, cursor = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                cursor = max(cursor, _find_after(full, str(message.get("content") or ""), cursor)[1])
                continue
            before = self._apply(messages[:i], True, where) if i else ""
            through = self._apply(messages[:i + 1], False, where)
            if not through.startswith(before):
                raise UsageError("the chat template renders the start of a conversation differently from the "
                                 "whole conversation, so the answers cannot be located; use a template that only "
                                 "appends turns (--chat_template FILE), or pass --train_on_prompt")
            if full.startswith(through):
                span = self._answer_span(through, len(before), message)
            else:  # this turn is rendered otherwise in the whole conversation (its reasoning left out)
                prompt = before[len(self._apply(messages[:i], False, where)):] if i else before
                start, known = self._turn_start(full, cursor, prompt, message)
                span = self._answer_span(full, start, message, known)
            spans.append(span)
            cursor = max(cursor, span[1])
        return full, spans

    @staticmethod
    def _turn_start(full: str, cursor: int, prompt: str, message: dict) -> tuple[int, bool]:
        """Where a turn found by its text starts in the whole conversation: after
        the last generation prompt (`prompt`'s text) before its answer; (the
        search's start, False) when the template wrote none there."""
        reasoning, answer = reasoning_and_answer(message)
        at = min((p for p in (full.find(answer.strip(), cursor), full.find(reasoning.strip(), cursor) if
                              reasoning.strip() else -1) if p >= 0), default=-1)
        header = full.rfind(prompt, cursor, at) if prompt and at >= 0 else -1
        return (header + len(prompt), True) if header >= 0 else (cursor, False)

    def _answer_span(self, text: str, turn_start: int, message: dict, known_start: bool = True) -> tuple[int, int]:
        """What the model writes of its turn: from where the generation prompt
        ends (`turn_start`; a harmony channel header, a <think> block and the
        answer are all the model's) through the first special token after the
        answer (its end-of-turn token); what follows it (a newline) is never a
        target. With --train_on_reasoning false, from the end of the reasoning
        the template wrote. Where the turn's start is not `known_start` (a turn
        found in the whole conversation by its text), from the reasoning or the answer."""
        reasoning, answer = reasoning_and_answer(message)
        turn = text[turn_start:]
        found = next(((turn.find(c), c) for c in (answer, answer.strip()) if c and turn.find(c) >= 0), None)
        at_answer, after = (found[0], found[0] + len(found[1])) if found else (0, 0)
        thought = turn.find(reasoning.strip()) if reasoning.strip() else -1
        wrote_reasoning = 0 <= thought < at_answer
        if wrote_reasoning and not self.train_on_reasoning:
            start = thought + len(reasoning.strip())
        elif known_start:
            start = 0
        else:
            start = thought if wrote_reasoning else at_answer
        ends = [(turn.find(t, after), t) for t in self.special_tokens]
        ends = [(pos, tok) for pos, tok in ends if pos >= 0]
        end = min(pos + len(tok) for pos, tok in ends) if ends else len(turn)
        return turn_start + start, turn_start + end

    def _template(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _apply(self, messages: list[dict], generation_prompt: bool, where: str) -> str:
        try:
            return self._template(messages, generation_prompt)
        except TemplateError as e:  # templates refuse what they cannot render (a system turn, roles out of order)
            raise UsageError(f"{where}: the chat template refused the conversation ({e}); fix that example, or "
                             "pass --chat_template FILE with a template that renders it") from None
        except Exception as e:  # noqa: BLE001  (template code failing on this example's content)
            raise UsageError(f"{where}: the chat template failed on it ({type(e).__name__}: {str(e)[:120]}); fix "
                             "that example, or the template") from None


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_FIELDS = ("reasoning_content", "thinking")


def reasoning_and_answer(message: dict) -> tuple[str, str]:
    """An assistant message's reasoning and answer: the reasoning from
    `reasoning_content` (Qwen3's templates), `thinking` (gpt-oss's) or a
    <think>...</think> block at the start of the content, which those templates
    split off the same way."""
    content = str(message.get("content") or "")
    reasoning = message.get("reasoning_content") or message.get("thinking") or ""
    if THINK_CLOSE in content:
        embedded, _, content = content.partition(THINK_CLOSE)
        reasoning = reasoning or embedded.split(THINK_OPEN, 1)[-1]
    return str(reasoning), content.lstrip("\n") if reasoning else content


def _find_after(text: str, part: str, start: int) -> tuple[int, int]:
    """Where `part` first occurs in `text` from `start` (its start and end; `start` twice if nowhere)."""
    at = text.find(part, start) if part else -1
    return (at, at + len(part)) if at >= 0 else (start, start)


def load_chat_template(tokenizer: PreTrainedTokenizerBase, template_file: str, data_format: str, model: str) -> None:
    """Install --chat_template FILE on the tokenizer (it is saved with the
    model), or check that the tokenizer has one of its own."""
    if template_file:
        path = Path(template_file)
        if not path.is_file():
            raise UsageError(f"--chat_template {template_file} {not_a_file(path)}; pass a Jinja template file")
        try:
            tokenizer.chat_template = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"--chat_template {path} is not UTF-8 text (byte {e.start}); pass a Jinja template "
                             "file") from None
        check_chat_template(tokenizer, f"--chat_template {path}")
    elif data_format in ("chat", "instruction") and not tokenizer.chat_template:
        raise UsageError(f"--data_format {data_format} is rendered with a chat template, and the tokenizer of "
                         f"--model {model} has none; pass --chat_template FILE")


# --- examples -> training rows --------------------------------------------------------------------

@dataclass
class SFTStats:
    examples: int = 0
    truncated: int = 0
    dropped_long: int = 0
    dropped_no_target: int = 0

    def describe(self) -> str:
        return counted(f"{self.examples} examples", {"truncated": self.truncated,
                                                      "longer than --block_size dropped": self.dropped_long,
                                                      "dropped with no answer token left": self.dropped_no_target})


def counted(kept: str, notes: dict[str, int]) -> str:
    """'12 examples (3 truncated, 1 dropped ...)': what was kept, and the counts that are not 0."""
    shown = [f"{count} {what}" for what, count in notes.items() if count]
    return kept + (f" ({', '.join(shown)})" if shown else "")


def encode_split(split: Dataset, encoder: ChatEncoder, block_size: int, long_examples: str, desc: str,
                 num_proc: int = 0) -> tuple[Dataset, SFTStats]:
    """Token ids and labels, one example per row, fitted to `block_size`."""
    def encode(batch, indices):
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        encoded = [encoder.encode(row, i) for row, i in zip(rows, indices)]
        return {"input_ids": [e.input_ids for e in encoded], "labels": [e.labels for e in encoded]}

    tokens = split.map(encode, batched=True, with_indices=True, remove_columns=split.column_names, desc=desc,
                       num_proc=num_proc or None)
    stats = SFTStats()
    kept_ids, kept_labels = [], []
    for ids, labels in zip(tokens["input_ids"], tokens["labels"]):
        fitted, outcome = fit_to_block(ids, labels, block_size, long_examples)
        stats.truncated += outcome == "truncated"
        stats.dropped_long += outcome == "dropped_long"
        stats.dropped_no_target += outcome == "dropped_no_target"
        if fitted is not None:
            kept_ids.append(fitted[0])
            kept_labels.append(fitted[1])
    stats.examples = len(kept_ids)
    return Dataset.from_dict({"input_ids": kept_ids, "labels": kept_labels}), stats


def fit_to_block(ids: list[int], labels: list[int], block_size: int,
                 long_examples: str) -> tuple[tuple[list[int], list[int]] | None, str]:
    """An example fitted to `block_size` (cut, or dropped with --long_examples
    drop), or None when no answer token is left; and what happened to it:
    kept, truncated, dropped_long or dropped_no_target."""
    outcome = "kept"
    if len(ids) > block_size:
        if long_examples == "drop":
            return None, "dropped_long"
        ids, labels, outcome = ids[:block_size], labels[:block_size], "truncated"
    if all(label == IGNORE for label in labels[1:]):  # the first token is never predicted
        return None, "dropped_no_target"
    return (ids, labels), outcome


def pack(examples: Dataset, block_size: int) -> Dataset:
    """Best-fit decreasing: each example, longest first, goes into the fullest
    block it still fits in. Position ids restart at 0 at every example: the
    attention mask is built from them, and positional embeddings see each
    example as if it were alone."""
    lengths = [len(ids) for ids in examples["input_ids"]]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    blocks: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, block index), sorted
    for i in order:
        slot = bisect.bisect_left(free, (lengths[i], -1))
        if slot == len(free):
            blocks.append([i])
            bisect.insort(free, (block_size - lengths[i], len(blocks) - 1))
        else:
            space, block = free.pop(slot)
            blocks[block].append(i)
            bisect.insort(free, (space - lengths[i], block))
    ids, labels = examples["input_ids"], examples["labels"]
    return Dataset.from_dict({
        "input_ids": [[t for i in block for t in ids[i]] for block in blocks],
        "labels": [[t for i in block for t in mask_first(labels[i])] for block in blocks],
        "position_ids": [[p for i in block for p in range(lengths[i])] for block in blocks],
    })


def mask_first(labels: list[int]) -> list[int]:
    """An example's first token is never predicted: in a packed block the
    position before it belongs to another example."""
    return [IGNORE] + labels[1:]


def unpacked(examples: Dataset) -> Dataset:
    return examples.map(lambda row: {"position_ids": list(range(len(row["input_ids"])))}, desc="positions")


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Padding is masked and has no target, so any id does; many tokenizers have no pad token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# Per-row counts of what each source of a mixture put in the row (see mixture.py).
SOURCE_COUNTS = ("source_tokens", "source_examples")


def stack_rows(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Rows of equal length (text blocks) as tensors."""
    return {key: torch.tensor([row[key] for row in rows]) for key in rows[0]}


class PadCollator:
    """Pads a batch to its longest row: input ids with `pad_id`, labels with
    -100; `attention_mask` marks the real tokens."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        batch = {"input_ids": torch.full((len(rows), width), self.pad_id, dtype=torch.long),
                 "labels": torch.full((len(rows), width), IGNORE, dtype=torch.long),
                 "position_ids": torch.zeros((len(rows), width), dtype=torch.long),
                 "attention_mask": torch.zeros((len(rows), width), dtype=torch.long)}
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            batch["input_ids"][i, :n] = torch.tensor(row["input_ids"])
            batch["labels"][i, :n] = torch.tensor(row["labels"])
            batch["position_ids"][i, :n] = torch.tensor(row["position_ids"])
            batch["attention_mask"][i, :n] = 1
        for key in SOURCE_COUNTS:
            if key in rows[0]:
                batch[key] = torch.tensor([row[key] for row in rows])
        return batch


def build_sft_splits(raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, data_format: str, block_size: int,
                     train_on_prompt: bool, packing: bool, long_examples: str,
                     num_proc: int = 0, train_on_reasoning: bool = True) -> tuple[DatasetDict, str]:
    """Training rows for every split, and a one-line description of them."""
    encoder = ChatEncoder(tokenizer, data_format, train_on_prompt, train_on_reasoning)
    out, notes = {}, []
    for name, split in raw.items():
        examples, stats = encode_split(split, encoder, block_size, long_examples, f"rendering {name} {data_format}",
                                       num_proc)
        if stats.examples == 0:
            fix = ("raise --block_size or pass --long_examples truncate" if long_examples == "drop"
                   else "raise --block_size: cut there, no example keeps a token of its answer")
            raise UsageError(f"no {name} example is left after fitting to --block_size {block_size} "
                             f"({stats.describe()}); {fix}")
        out[name] = pack(examples, block_size) if packing else unpacked(examples)
        notes.append(f"{name}: {stats.describe()}" + (f" in {len(out[name])} packed blocks" if packing else ""))
    return DatasetDict(out), "; ".join(notes)
