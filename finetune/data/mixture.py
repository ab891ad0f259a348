"""Training rows from one or more sources, drawn with weights, read in order:
the path of streamed data, and of every mixture.

    sources  each a factory of an iterable of raw rows (this rank's part of a stream)
    picks    which source the next example comes from: a function of (seed, rank, pass, n)
    encode   text -> token ids and an end-of-text token; chat/instruction -> ids and labels
    rows     blocks of concatenated text, packed examples, or one example per row

Every row carries `source_tokens` and `source_examples` (one count per
source), which the batches add up for summary.json's `sources`.

The position after every row is a small JSON-able dict: the sources' reading
states before the chunk of examples being used, how many of that chunk's
examples were used, and what the row builder holds (a partial block). Reading
the same chunk again and skipping the used examples puts a resumed stream
exactly where it was, whatever the number of encoding workers.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import multiprocessing
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from finetune.data.chat import (
    ChatEncoder,
    PadCollator,
    fit_to_block,
    load_chat_template,
    mask_first,
    pad_id,
    stack_rows,
)
from finetune.data.sources import root_cause
from finetune.errors import UsageError
from finetune.stopping import leave_the_launch

CHUNK = 128          # raw examples read and encoded together
PICKS_PER_DRAW = 4096  # source choices drawn from one generator
OPEN_BLOCKS = 4      # packed blocks an example may still go into


@dataclass
class Source:
    name: str                          # as --dataset gave it
    weight: float                      # its share of the examples drawn
    data_format: str                   # text, chat, instruction or prompt_completion
    open: Callable[[], Any]            # a fresh iterable of its raw training rows (IterableDataset or Dataset)
    text_column: str = "text"
    held_out: float = 0.0              # the fraction of its rows kept for evaluation (by content), skipped here


def row_digest(row) -> bytes:
    return hashlib.blake2b(json.dumps(row, sort_keys=True, default=str).encode(), digest_size=8).digest()


def is_held_out(row: dict, fraction: float) -> bool:
    """Whether a streamed row is held out for evaluation: decided by a hash of
    its content, the same on every rank, every pass and every resume."""
    if fraction <= 0:
        return False
    return int.from_bytes(row_digest(row), "little") / 2**64 < fraction


class DataReadError(UsageError):
    """A source that cannot be read part-way through."""


# --- which source next ----------------------------------------------------------------------------

class Picks:
    """The source of the n-th example of a pass, the same on every resume."""

    def __init__(self, weights: list[float], seed: int, rank: int, data_pass: int):
        self.probabilities = np.asarray(weights, dtype=np.float64) / sum(weights)
        self.key = [seed, rank, data_pass]
        self._draw, self._choices = -1, np.empty(0, dtype=np.int64)

    def __getitem__(self, n: int) -> int:
        draw = n // PICKS_PER_DRAW
        if draw != self._draw:
            rng = np.random.default_rng([*self.key, draw])
            self._draw = draw
            self._choices = rng.choice(len(self.probabilities), size=PICKS_PER_DRAW, p=self.probabilities)
        return int(self._choices[n % PICKS_PER_DRAW])


# --- raw rows -> examples -------------------------------------------------------------------------

@dataclass
class Example:
    input_ids: list[int]
    labels: list[int] | None  # None: every token is a target (text)
    source: int
    starts: bool = True       # the first piece of a document (what the per-source example counts count)


class Encoder:
    """Token ids of raw rows, by each source's format, fitted to the block
    size like the map-style path does (chat.encode_split)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, sources: list[Source], block_size: int,
                 train_on_prompt: bool, long_examples: str, pieces: bool, train_on_reasoning: bool = True):
        self.tokenizer, self.block_size, self.long_examples = tokenizer, block_size, long_examples
        self.names = [s.name for s in sources]
        self.text_columns = [s.text_column for s in sources]
        self.formats = [s.data_format for s in sources]
        self.chat = {fmt: ChatEncoder(tokenizer, fmt, train_on_prompt, train_on_reasoning)
                     for fmt in set(self.formats) if fmt != "text"}
        self.pieces = pieces  # text as examples of at most block_size (a mixture with chat data)

    def __call__(self, raw: list[tuple[int, int, dict]]) -> list[Example | None]:
        """(source, example number, row) -> an example, or None for one that is dropped."""
        texts = [(i, self._text(s, number, row)) for i, (s, number, row) in enumerate(raw) if self.formats[s] == "text"]
        ids = self.tokenizer([t for _, t in texts])["input_ids"] if texts else []
        out: list[Example | None] = [None] * len(raw)
        for (i, text), tokens in zip(texts, ids):
            if text and text.strip():
                out[i] = Example(tokens + [self.tokenizer.eos_token_id], None, raw[i][0])
        for i, (s, number, row) in enumerate(raw):
            if self.formats[s] != "text":
                try:
                    encoded = self.chat[self.formats[s]].encode(row, number - 1)
                except UsageError as e:  # "example N: ...": of which source, in a mixture
                    raise UsageError(f"--dataset {self.names[s]}: {e}") from None
                out[i] = self._fitted(encoded, s)
        if self.pieces:
            return [piece for example in out for piece in self._pieces(example)]
        return out

    def _text(self, source: int, number: int, row: dict) -> str:
        """A text row's document ("" for none); a row of another shape part-way through a stream is bad data."""
        text = row.get(self.text_columns[source])
        if text is not None and not isinstance(text, str):
            raise UsageError(f"--dataset {self.names[source]}: example {number} holds {type(text).__name__} in column "
                             f"{self.text_columns[source]!r}, not text; fix that row (or pass --text_column)")
        return text or ""

    def _fitted(self, encoded, source: int) -> Example | None:
        fitted, _ = fit_to_block(encoded.input_ids, encoded.labels, self.block_size, self.long_examples)
        return Example(*fitted, source) if fitted is not None else None

    def _pieces(self, example: Example | None) -> list[Example | None]:
        if example is None or example.labels is not None:
            return [example]
        size = self.block_size
        return [Example(example.input_ids[i:i + size], example.input_ids[i:i + size], example.source, starts=i == 0)
                for i in range(0, len(example.input_ids), size) if len(example.input_ids[i:i + size]) > 1]


# --- examples -> rows -----------------------------------------------------------------------------

class RowBuilder:
    """Rows from examples, one mode per run: `blocks` (text only: documents
    concatenated, cut every block_size tokens, the tail of a pass dropped),
    `packed` (examples kept whole, first fit into a few open blocks, position
    ids restarting at every example), `examples` (one per row) or `rows` (the
    rows as read and checked, which the run's collator renders: images). Its
    state is what it holds between rows."""

    def __init__(self, mode: str, block_size: int, sources: int):
        self.mode, self.block_size, self.sources = mode, block_size, sources
        self.carry: list[int] = []                   # blocks: tokens not in a row yet
        self.carry_sources: list[list[int]] = []     # blocks: [source, tokens, starts a document] runs of the carry
        self.open: list[dict] = []                   # packed: blocks still filling
        self.ready: deque[dict] = deque()            # rows built, not yet taken

    def state_dict(self) -> dict:
        return {"carry": list(self.carry), "carry_sources": copy.deepcopy(self.carry_sources),
                "open": copy.deepcopy(self.open), "ready": copy.deepcopy(list(self.ready))}

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        self.carry, self.carry_sources = list(state["carry"]), copy.deepcopy(state["carry_sources"])
        self.open, self.ready = copy.deepcopy(state["open"]), deque(copy.deepcopy(state["ready"]))

    def check_state(self, state) -> None:
        """A saved state this builder could have held, or one line: a damaged
        or edited position would go on building rows of other data (or end in
        a traceback several steps on)."""
        def ids(value) -> bool:
            return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in value)

        def piece(p) -> bool:
            return (isinstance(p, dict) and ids(p.get("input_ids")) and isinstance(p.get("labels"), list)
                    and len(p["labels"]) == len(p["input_ids"]) <= self.block_size
                    and p.get("source") in range(self.sources) and p.get("starts") in (0, 1))

        problem = None
        if not isinstance(state, dict) or not {"carry", "carry_sources", "open", "ready"} <= set(state):
            problem = "it lacks the builder's carry, open blocks or ready rows"
        elif not ids(state["carry"]) or len(state["carry"]) > self.block_size:
            problem = f"its carry is not a list of at most {self.block_size} token ids"
        elif not (isinstance(state["carry_sources"], list) and all(
                isinstance(run, list) and len(run) == 3 and run[0] in range(self.sources) and isinstance(run[1], int)
                and run[1] >= 0 and run[2] in (0, 1) for run in state["carry_sources"])
                and sum(run[1] for run in state["carry_sources"]) == len(state["carry"])):
            problem = "its carry's sources do not add up to the carry"
        elif not (isinstance(state["open"], list) and all(
                isinstance(block, dict) and isinstance(block.get("pieces"), list)
                and all(piece(p) for p in block["pieces"])
                and block.get("length") == sum(len(p["input_ids"]) for p in block["pieces"]) <= self.block_size
                for block in state["open"])):
            problem = "its open blocks are not blocks of whole examples"
        elif not (isinstance(state["ready"], list) and all(
                isinstance(row, dict) and ids(row.get("input_ids")) and len(row["input_ids"]) <= self.block_size
                and isinstance(row.get("labels"), list) and len(row["labels"]) == len(row["input_ids"])
                for row in state["ready"])):
            problem = "its ready rows are not rows of this block size"
        if problem:
            raise UsageError(f"the checkpoint's stream position is not one this data can take ({problem}); the "
                             "checkpoint is damaged: resume from an earlier one")

    def add(self, example: Example) -> None:
        if self.mode == "blocks":
            self.carry += example.input_ids
            self.carry_sources.append([example.source, len(example.input_ids), 1])
            # Every full block cut, then the carry shortened once: one huge document (millions of
            # tokens) would otherwise be copied once per block, in quadratic time.
            start = 0
            while len(self.carry) - start >= self.block_size:
                self._cut_block(start)
                start += self.block_size
            del self.carry[:start]
            return
        if self.mode == "rows":  # handed on at once: a saved state never holds one
            self.ready.append(example)
            return
        labels = example.labels if example.labels is not None else list(example.input_ids)
        piece = {"input_ids": example.input_ids, "labels": labels, "source": example.source, "starts": example.starts}
        if self.mode == "examples":
            self.ready.append(self._row([piece], packed=False))
            return
        fits = [block for block in self.open if block["length"] + len(example.input_ids) <= self.block_size]
        if fits:
            fits[0]["pieces"].append(piece)
            fits[0]["length"] += len(example.input_ids)
            return
        if len(self.open) == OPEN_BLOCKS:  # the fullest goes out, to make room
            fullest = max(self.open, key=lambda block: block["length"])
            self.open.remove(fullest)
            self.ready.append(self._row(fullest["pieces"], packed=True))
        self.open.append({"pieces": [piece], "length": len(example.input_ids)})

    def end_of_pass(self) -> None:
        """Packed blocks still filling go out; a text tail shorter than a block is dropped."""
        for block in self.open:
            self.ready.append(self._row(block["pieces"], packed=True))
        self.open, self.carry, self.carry_sources = [], [], []

    def pop(self) -> dict | None:
        return self.ready.popleft() if self.ready else None

    def _cut_block(self, start: int) -> None:
        """The block of the carry from `start`; the caller drops what was cut."""
        size = self.block_size
        tokens, examples, left = [0] * self.sources, [0] * self.sources, size
        while left:
            run = self.carry_sources[0]
            used = min(run[1], left)
            tokens[run[0]] += used
            examples[run[0]] += run[2]
            run[2] = 0  # the document's start is counted once
            run[1] -= used
            left -= used
            if run[1] == 0:
                self.carry_sources.pop(0)
        self.ready.append({"input_ids": self.carry[start:start + size], "source_tokens": tokens,
                           "source_examples": examples})

    def _row(self, pieces: list[dict], packed: bool) -> dict:
        tokens, examples = [0] * self.sources, [0] * self.sources
        for piece in pieces:
            tokens[piece["source"]] += len(piece["input_ids"])
            examples[piece["source"]] += piece["starts"]
        return {"input_ids": [t for p in pieces for t in p["input_ids"]],
                "labels": [t for p in pieces for t in (mask_first(p["labels"]) if packed else p["labels"])],
                "position_ids": [i for p in pieces for i in range(len(p["input_ids"]))],
                "source_tokens": tokens, "source_examples": examples}


def row_mode(formats: list[str], packing: bool) -> str:
    if all(fmt == "text" for fmt in formats):
        return "blocks"
    return "packed" if packing else "examples"


# --- the stream -----------------------------------------------------------------------------------

class RowStream:
    """This rank's rows of one pass, each with the position after it; every
    pass (`rows(data_pass)`) reads the sources from their beginning, drawn anew."""

    def __init__(self, sources: list[Source], encoder: Encoder, mode: str, block_size: int, stop: str, seed: int,
                 rank: int, workers: int = 0):
        self.sources, self.encoder, self.stop, self.seed, self.rank = sources, encoder, stop, seed, rank
        self.mode, self.block_size = mode, block_size
        self.workers = workers
        self._pool = None

    def rows(self, data_pass: int, position: dict | None = None) -> Iterator[tuple[dict, dict]]:
        """(row, position after it) until the pass ends; from `position` when given."""
        builder = RowBuilder(self.mode, self.block_size, len(self.sources))
        readers = [self._reader(i) for i in range(len(self.sources))]
        state = {"picked": 0, "done": [False] * len(self.sources), "numbers": [0] * len(self.sources),
                 "readers": [None] * len(self.sources)}
        skip = 0
        if position is not None:  # read the chunk in use again, skip what was used, refill the builder
            self.check_position(position)
            state = copy.deepcopy(position["chunk"])
            readers = [self._reader(i, reader_state) for i, reader_state in enumerate(state["readers"])]
            skip = position["used"]
            builder.load_state_dict(position["builder"])
            while (row := builder.pop()) is not None:
                yield row, {**position, "builder": builder.state_dict()}
        chunk_state, examples = state, []
        picks = Picks([s.weight for s in self.sources], self.seed, self.rank, data_pass)
        for chunk_state, examples in self._encoded_chunks(readers, picks, state):
            if position is not None:  # the chunk read again must be the one the position was saved in
                self.check_same_chunk(position["chunk"], chunk_state)
                position = None
            for used in range(skip, len(examples)):
                if examples[used] is not None:
                    builder.add(examples[used])
                while (row := builder.pop()) is not None:
                    yield row, {"chunk": chunk_state, "used": used + 1, "builder": builder.state_dict()}
            skip = 0
        if position is not None:  # the chunk the position was saved in is not there to read again
            self.check_same_chunk(position["chunk"], {})
        builder.end_of_pass()
        while (row := builder.pop()) is not None:
            yield row, {"chunk": chunk_state, "used": len(examples), "builder": builder.state_dict()}

    def check_position(self, position: dict) -> None:
        """The chunk a position names, and how much of it was used, as this stream could have left them."""
        chunk, n = position.get("chunk"), len(self.sources)
        counts = (lambda v: isinstance(v, list) and len(v) == n and all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in v))
        if not (isinstance(chunk, dict) and isinstance(chunk.get("picked"), int) and chunk["picked"] >= 0
                and isinstance(chunk.get("done"), list) and len(chunk["done"]) == n
                and all(isinstance(d, bool) for d in chunk["done"]) and counts(chunk.get("numbers"))
                and isinstance(chunk.get("readers"), list) and len(chunk["readers"]) == n
                and all(r is None or isinstance(r, dict) for r in chunk["readers"])
                and isinstance(position.get("used"), int) and 0 <= position["used"] <= CHUNK):
            raise UsageError(f"the checkpoint's stream position is not one this data can take (its chunk of {n} "
                             f"source(s) or the {CHUNK} examples it used); the checkpoint is damaged: resume from an "
                             "earlier one")

    @staticmethod
    def check_same_chunk(saved: dict, read: dict) -> None:
        """A position beyond what its source holds (an example index past a
        shard's end) or data changed under it reads other rows: refused, not
        trained on. Positions saved before the digest existed are not checked."""
        if "first_row" in saved and saved["first_row"] != read.get("first_row"):
            raise UsageError("the checkpoint's stream position does not lead to the rows it was saved at (its "
                             "example index is past the data, or the data changed); the checkpoint is damaged or "
                             "its data is not the same: resume from an earlier checkpoint, with the run's own data")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None

    def _encoded_chunks(self, readers: list, picks: Picks, state: dict) -> Iterator[tuple[dict, list]]:
        """(the reading state before the chunk, its encoded examples), with up
        to 2 x workers chunks encoding ahead in worker processes."""
        chunks = self._raw_chunks(readers, picks, state)
        if not self.workers:
            for chunk_state, raw in chunks:
                yield chunk_state, self.encoder(raw)
            return
        if self._pool is None:  # forked once: the workers hold the tokenizer
            self._pool = multiprocessing.get_context("fork").Pool(self.workers, _set_encoder, (self.encoder,))
        window: deque = deque()
        for chunk_state, raw in chunks:
            window.append((chunk_state, self._pool.apply_async(_encode, (raw,))))
            if len(window) >= 2 * self.workers:
                chunk_state, result = window.popleft()
                yield chunk_state, result.get()
        while window:
            chunk_state, result = window.popleft()
            yield chunk_state, result.get()

    def _raw_chunks(self, readers: list, picks: Picks, state: dict) -> Iterator[tuple[dict, list]]:
        """(state before, [(source, example number, row)]) chunks until the mixture stops."""
        iterators = [iter(reader) for reader in readers]
        while True:
            before = copy.deepcopy({**state, "readers": [reader.state_dict() for reader in readers]})
            raw, ended = [], False
            while len(raw) < CHUNK:
                source = picks[state["picked"]]
                row, read = self._next(iterators[source], source)
                if row is None:  # this source ran out
                    state["done"][source] = True
                    if self.stop == "first_exhausted" or all(state["done"]):
                        ended = True
                        break
                    readers[source] = self._reader(source)
                    iterators[source] = iter(readers[source])
                    state["numbers"][source] = 0  # a new pass: numbers are the file's rows again
                    row, read = self._next(iterators[source], source)
                    if row is None:
                        raise UsageError(f"--dataset {self.sources[source].name} has no training examples for rank "
                                         f"{self.rank}; give it more examples or shards, or launch fewer processes")
                state["picked"] += 1
                state["numbers"][source] += read
                raw.append((source, state["numbers"][source], row))
            if raw:  # the chunk's first row, by content: what a resume from `before` must read first
                yield {**before, "first_row": row_digest(raw[0][2]).hex()}, raw
            if ended:
                return

    def _reader(self, source: int, state: dict | None = None):
        reader = self.sources[source].open()
        if not hasattr(reader, "state_dict"):  # rows in memory (a map-style split)
            reader = IndexedRows(reader)
        if state is not None:
            reader.load_state_dict(state)
        return reader

    def _next(self, iterator: Iterator, source: int) -> tuple[dict | None, int]:
        """The next training row, and how many rows were read for it (the held-out ones
        skipped count: an example's number is its row in the source)."""
        read = 1
        try:
            row = next(iterator)
            while is_held_out(row, self.sources[source].held_out):
                row, read = next(iterator), read + 1
            return row, read
        except StopIteration:
            return None, read
        except Exception as e:  # datasets raises many types for a file it cannot parse
            raise DataReadError(f"could not read --dataset {self.sources[source].name} part-way through "
                                f"({type(e).__name__}: {root_cause(e)}); fix or remove the damaged file, then "
                                "resume from the last checkpoint") from None


class IndexedRows:
    """Rows in memory, read in order, with the position an IterableDataset has."""

    def __init__(self, rows):
        self.rows, self.index = rows, 0

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        index = state.get("index") if isinstance(state, dict) else None
        if not (isinstance(index, int) and not isinstance(index, bool) and 0 <= index <= len(self.rows)):
            raise UsageError(f"the checkpoint's stream position is not one this data can take (row {index!r} of "
                             f"{len(self.rows)}); the checkpoint is damaged: resume from an earlier one")
        self.index = index

    def __iter__(self) -> Iterator[dict]:
        while self.index < len(self.rows):
            self.index += 1
            yield self.rows[self.index - 1]


_worker_encoder: Encoder | None = None


def _set_encoder(encoder: Encoder) -> None:
    """A forked worker's start. With the rank's stop handlers, which only
    record a request, a worker waiting on the pool's queue outlived the pool's
    SIGTERM and the rank hung joining it at the run's end; a worker in the
    middle of a chunk the rank waits for must not get the launch's stop either
    (stopping.leave_the_launch)."""
    global _worker_encoder
    _worker_encoder = encoder
    leave_the_launch()


def _encode(raw: list) -> list[Example | None]:
    return _worker_encoder(raw)


class MixedRows:
    """The rows of a run's sources (text.load_sources), built one way for
    training and evaluation: the row mode, the encoder and the collate."""

    def __init__(self, loaded, tokenizer: PreTrainedTokenizerBase, cfg):
        self.loaded, self.cfg = loaded, cfg
        self.formats = [source.data_format for source in loaded.sources]
        for data_format in dict.fromkeys(f for f in self.formats if f != "text"):
            load_chat_template(tokenizer, cfg.chat_template, data_format, cfg.model)
        self.mode = row_mode(self.formats, cfg.packing)
        self.encoder = Encoder(tokenizer, loaded.sources, cfg.block_size, cfg.train_on_prompt, cfg.long_examples,
                               pieces=self.mode != "blocks", train_on_reasoning=cfg.train_on_reasoning)
        self.collate = stack_rows if self.mode == "blocks" else PadCollator(pad_id(tokenizer))
        self.data_format = self.formats[0] if len(set(self.formats)) == 1 else "mixture"

    def stream(self, rank: int, workers: int = 0) -> RowStream:
        return RowStream(self.loaded.sources, self.encoder, self.mode, self.cfg.block_size, self.cfg.mixture_stop,
                         self.cfg.seed, rank, workers)

    def held_out(self) -> Dataset:
        """Every source's held-out rows, built source by source (a block holds one source's text)."""
        sources, rows = self.loaded.sources, []
        for i, held_out in enumerate(self.loaded.validation):
            alone = [dataclasses.replace(source, weight=float(j == i), open=lambda held_out=held_out: held_out,
                                         held_out=0.0) for j, source in enumerate(sources)]
            stream = RowStream(alone, self.encoder, self.mode, self.cfg.block_size, "first_exhausted", self.cfg.seed,
                               rank=0)
            rows += [row for row, _ in stream.rows(0)]
        if not rows:
            raise UsageError(f"no held-out row is left of {', '.join(s.name for s in sources)} after fitting to "
                             f"--block_size {self.cfg.block_size}; add held-out examples or lower --block_size")
        return Dataset.from_list(rows)
