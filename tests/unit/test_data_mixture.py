"""Unit tests of the row stream (finetune/data/mixture.py)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

# A rank's state when its stream forks encoding workers: a SIGTERM handler that
# only records a stop request (finetune/stopping.py), as during training.
WORKERS_UNDER_A_STOP_HANDLER = """
import multiprocessing, signal, sys, time
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
print(round(time.monotonic() - start, 1), [w.is_alive() for w in workers])
"""


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
