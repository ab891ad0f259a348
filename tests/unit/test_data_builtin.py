"""Unit tests of the built-in corpus."""

from __future__ import annotations

import json


def test_builtin_corpus_is_real_text_and_deterministic(tmp_path, monkeypatch):
    from finetune.data.builtin import build_stdlib_corpus

    built = []
    for cache in ("first", "second"):  # two independent builds, nothing shared
        monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / cache))
        built.append(build_stdlib_corpus())
    assert built[0] != built[1] and built[0].read_bytes() == built[1].read_bytes()
    docs = [json.loads(line)["text"] for line in built[0].read_text().splitlines()]
    assert len(docs) > 1000 and sum(map(len, docs)) > 500_000
    words = " ".join(docs[:200]).split()
    assert sum(w.lower() in {"the", "a", "of", "is", "to"} for w in words) > 0.05 * len(words)
    import argparse

    assert argparse.__doc__.strip() in docs  # module docstrings are read from the source files
