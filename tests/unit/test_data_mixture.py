"""Unit tests of the row stream (finetune/data/mixture.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

# A rank's state when its stream forks encoding workers: a SIGTERM handler that
# only records a stop request (finetune/stopping.py), as during training.
WORKERS_UNDER_A_STOP_HANDLER = """
import faulthandler, multiprocessing, signal, sys, time
faulthandler.dump_traceback_later(120, exit=True)  # a hang says where (seen once under a whole suite's load)
sys.path.insert(0, "tests")
from sft_models import chat_tokenizer
from finetune.data.mixture import Encoder, RowStream, Source

signal.signal(signal.SIGTERM, lambda *_: None)
docs = [f"document {i} " + "word " * (i % 13 + 3) for i in range(600)]
sources = [Source("text", 1.0, "text", lambda: [{"text": d} for d in docs])]
encoder = Encoder(chat_tokenizer(docs[:50]), sources, 16, False, "truncate", pieces=False)
stream = RowStream(sources, encoder, "blocks", 16, "first_exhausted", seed=0, rank=0, workers=2)
rows = stream.rows(0)
for _ in range(5):
    next(rows)
workers = list(multiprocessing.active_children())
assert len(workers) == 2, workers
start = time.monotonic()
stream.close()
for worker in workers:
    worker.join(20)
print(round(time.monotonic() - start, 1), [w.is_alive() for w in workers], flush=True)  # shown even if the exit hangs
"""


@pytest.mark.slow  # a fresh interpreter of its own (what it imports): not the quick tier's
def test_encoding_workers_end_when_the_stream_closes_whatever_the_rank_does_with_sigterm():
    """They inherit the rank's handlers: one that only records a stop kept a
    worker alive through the pool's SIGTERM, and the rank hung at the run's end."""
    proc = subprocess.run([sys.executable, "-c", WORKERS_UNDER_A_STOP_HANDLER], cwd=REPO, capture_output=True,
                          text=True, timeout=240)  # hung for good before the fix
    assert proc.returncode == 0, proc.stderr[-2000:]
    seconds, alive = proc.stdout.split(maxsplit=1)
    assert alive.strip() == "[False, False]" and float(seconds) < 20, proc.stdout


def test_a_bad_row_of_a_mixture_names_its_source():
    import pytest

    from finetune.data.mixture import Encoder, Source
    from finetune.errors import UsageError
    from sft_models import chat_tokenizer

    sources = [Source("notes.txt", 0.5, "text", list), Source("chats.jsonl", 0.5, "chat", list)]
    encoder = Encoder(chat_tokenizer(["some text", "more words"]), sources, 32, False, "truncate", pieces=True)
    bad = {"messages": [{"role": "wizard", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    with pytest.raises(UsageError, match=r"^--dataset chats.jsonl: example 3\b"):
        encoder([(0, 1, {"text": "fine"}), (1, 3, bad)])


def test_a_streamed_example_is_numbered_by_its_row_in_the_file_held_out_rows_included():
    """Rows held out for evaluation are read and skipped: "example N" is still
    the source's N-th row."""
    import pytest

    from finetune.data.mixture import Encoder, RowStream, Source, is_held_out
    from finetune.errors import UsageError
    from sft_models import chat_tokenizer

    docs = [{"text": f"document {i} " + "word " * (i % 7 + 3)} for i in range(40)]
    held_out = 0.3
    bad_row = next(i for i in range(20, 40) if not is_held_out(docs[i], held_out))
    assert any(is_held_out(docs[i], held_out) for i in range(bad_row))  # rows before it are skipped
    rows = docs[:bad_row] + [{"text": ["not", "text"]}] + docs[bad_row + 1:]
    assert not is_held_out(rows[bad_row], held_out)
    sources = [Source("notes.jsonl", 1.0, "text", lambda: rows, held_out=held_out)]
    encoder = Encoder(chat_tokenizer([d["text"] for d in docs]), sources, 16, False, "truncate", pieces=False)
    stream = RowStream(sources, encoder, "blocks", 16, "first_exhausted", seed=0, rank=0)
    with pytest.raises(UsageError, match=f"^--dataset notes.jsonl: example {bad_row + 1} holds list"):
        list(stream.rows(0))


def test_one_huge_document_is_cut_into_blocks_in_linear_time():
    """A stream's document of millions of tokens: each block cut used to copy
    the rest of the carry (quadratic: minutes for this one, hours for a book
    collection in one row). A bound 50x above the linear time, not a benchmark."""
    import time

    from finetune.data.mixture import Example, RowBuilder

    builder = RowBuilder("blocks", 16, sources=2)
    builder.add(Example(list(range(10)), None, source=1))
    huge = list(range(10, 800_010))
    start = time.perf_counter()
    builder.add(Example(huge, None, source=0))
    seconds = time.perf_counter() - start
    rows = list(builder.ready)
    assert len(rows) == 800_010 // 16 and builder.carry == list(range(800_000, 800_010))
    assert [t for row in rows for t in row["input_ids"]] == list(range(800_000))
    assert rows[0]["source_tokens"] == [6, 10] and rows[0]["source_examples"] == [1, 1]
    assert rows[1]["source_tokens"] == [16, 0] and rows[1]["source_examples"] == [0, 0]
    assert seconds < 5, seconds


def test_a_stream_position_past_the_data_or_on_other_data_is_refused_not_trained_on(tmp_path):
    """A position is resumed by reading its chunk again from the readers'
    saved states: an example index past a shard's end (or changed data) reads
    other rows, which the chunk's first-row digest tells apart."""
    import copy
    import json

    import pytest
    from datasets import load_dataset

    from finetune.data.mixture import CHUNK, Encoder, RowStream, Source
    from finetune.errors import UsageError
    from sft_models import chat_tokenizer

    docs = [{"text": f"document {i} " + "word " * (i % 7 + 3)} for i in range(3 * CHUNK)]
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    sources = [Source("notes.jsonl", 1.0, "text", lambda: load_dataset(
        "json", data_files=str(tmp_path / "notes.jsonl"), split="train", streaming=True))]
    encoder = Encoder(chat_tokenizer([d["text"] for d in docs[:50]]), sources, 16, False, "truncate", pieces=False)
    stream = RowStream(sources, encoder, "blocks", 16, "first_exhausted", seed=0, rank=0)
    rows = stream.rows(0)
    for _ in range(CHUNK // 2 + 40):  # into the second chunk
        _, position = next(rows)
    expected = [row for row, _ in zip((r for r, _ in stream.rows(0, copy.deepcopy(position))), range(5))]
    assert expected == [next(rows)[0] for _ in range(5)]  # the same rows on from the position
    past_the_end = copy.deepcopy(position)
    reader = past_the_end["chunk"]["readers"][0]
    while "previous_state" not in reader:  # datasets' nesting: the rebatched reader resumes from previous_state
        reader = reader["examples_iterable"]
    reader["previous_state"]["shard_example_idx"] = 10**9
    with pytest.raises(UsageError, match="stream position does not lead to the rows it was saved at"):
        for _ in zip(stream.rows(0, past_the_end), range(10 * CHUNK)):  # past the rows the builder held
            pass
