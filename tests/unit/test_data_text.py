"""Unit tests of text data: documents into blocks, columns, empty files."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset, DatasetDict

from finetune.data.text import load_raw_data, load_raw_text, tokenize_and_group
from finetune.data.tokenizer import train_bpe_tokenizer
from finetune.errors import UsageError


def test_blocks_are_exact_with_end_of_text_between_documents():
    texts = ["alpha beta gamma delta", "epsilon zeta eta theta", "iota kappa lambda mu"] * 20
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    raw = DatasetDict(train=Dataset.from_dict({"text": texts}), validation=Dataset.from_dict({"text": texts[:6]}))
    blocks = tokenize_and_group(raw, tokenizer, block_size=16)
    stream = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    assert len(blocks["train"]) == len(stream) // 16
    assert blocks["train"][0]["input_ids"].tolist() == stream[:16]
    assert all(len(ids) == 16 for ids in blocks["train"]["input_ids"])


def test_a_wrapped_txt_file_is_a_document_per_paragraph_with_its_line_breaks(tmp_path):
    import textwrap

    words = [f"word{i}" for i in range(400)]
    paragraphs = [textwrap.fill(" ".join(words[i:i + 45]), 72) for i in range(0, 360, 45)]
    assert all(p.count("\n") >= 3 for p in paragraphs)  # wrapped at 72 columns
    (tmp_path / "wrapped.txt").write_text("\n\n".join(paragraphs) + "\n\n\n")
    tokenizer = train_bpe_tokenizer(paragraphs * 3, vocab_size=400)
    eos = tokenizer.eos_token_id

    def stream(sample_by: str) -> list[int]:
        raw = load_raw_text(str(tmp_path / "wrapped.txt"), "text", 0.0, 0, sample_by=sample_by)
        return [t for block in tokenize_and_group(raw, tokenizer, block_size=8)["train"]["input_ids"]
                for t in block.tolist()]

    by_paragraph = [t for p in paragraphs for t in tokenizer(p)["input_ids"] + [eos]]
    assert stream("paragraph") == by_paragraph[:len(by_paragraph) // 8 * 8]
    assert stream("paragraph").count(eos) == len(paragraphs) - (len(by_paragraph) % 8 > 0)
    lines = [line for p in paragraphs for line in p.splitlines()]
    by_line = [t for line in lines for t in tokenizer(line)["input_ids"] + [eos]]  # the old layout
    assert stream("line") == by_line[:len(by_line) // 8 * 8]
    whole = tokenizer("\n\n".join(paragraphs))["input_ids"] + [eos]
    assert stream("document") == whole[:len(whole) // 8 * 8]


def test_text_shorter_than_one_block_is_a_clear_error():
    tokenizer = train_bpe_tokenizer(["a few words of text"] * 5, vocab_size=280)
    raw = DatasetDict(train=Dataset.from_dict({"text": ["a few words"]}), validation=Dataset.from_dict({"text": ["a few"]}))
    with pytest.raises(UsageError, match="fewer than one block of --block_size 64"):
        tokenize_and_group(raw, tokenizer, block_size=64)


def test_a_held_out_share_too_small_for_one_block_names_the_split():
    from datasets import Dataset, DatasetDict

    texts = ["a document of a dozen words, long enough to fill blocks of sixteen tokens"] * 20
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    raw = DatasetDict(train=Dataset.from_dict({"text": texts}), validation=Dataset.from_dict({"text": ["a few"]}))
    with pytest.raises(UsageError, match="the validation text has .* tokens, fewer than one block of --block_size 32; "
                                         "hold out more \\(a larger --validation_split"):
        tokenize_and_group(raw, tokenizer, block_size=32)


def test_local_jsonl_needs_the_text_column(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"document {i}"}) for i in range(10)))
    with pytest.raises(UsageError, match="has no column 'text' .*columns: body.*--text_column"):
        load_raw_text(str(path), "text", 0.1, 0)
    raw = load_raw_text(str(path), "body", 0.2, 0)
    assert len(raw["train"]) == 8 and len(raw["validation"]) == 2 and raw["train"].column_names == ["text"]


def test_empty_data_file_is_a_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UsageError, match="is empty"):
        load_raw_text(str(tmp_path / "empty.txt"), "text", 0.1, 0)


def test_each_objective_names_its_own_format_when_the_columns_are_missing(tmp_path):
    """GRPO's prompts and DPO's pairs, read from data with other columns: the
    error names the objective's format and columns, never SFT's --text_column."""
    (tmp_path / "qa.jsonl").write_text('{"question": "q", "answer": "a"}\n' * 4)
    for objective, data_format, says in (
            ("grpo", "prompt", r"--method grpo trains on prompts alone .* no column\(s\) prompt "
                               r"\(columns: question, answer\); give each row \{\"prompt\""),
            ("dpo", "preference", r"--method dpo trains on preference pairs .* no column\(s\) chosen, rejected"),
            ("kto", "unpaired", r"--method kto trains on unpaired completions .* no column\(s\) prompt, completion, "
                                r"label .*\"label\": true")):
        with pytest.raises(UsageError, match=says) as caught:
            load_raw_data(str(tmp_path / "qa.jsonl"), data_format, "text", 0.25, 0, objective=objective)
        assert "--text_column" not in str(caught.value)


def test_a_long_pass_over_the_data_is_said_before_it_starts(monkeypatch, capsys):
    """A 23 MB document takes tens of seconds to train a tokenizer on and to
    tokenize: the console says so first (small data says nothing)."""
    from finetune.tasks import causal_lm

    class Main:
        def print(self, line):
            print(line)

    big = Dataset.from_dict({"text": ["word " * 50_000]})
    causal_lm.say_when_long(Main(), "tokenizing", big)
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(causal_lm, "LONG_DATA_BYTES", 100_000)
    causal_lm.say_when_long(Main(), "tokenizing", big, big)
    assert capsys.readouterr().out == "tokenizing 2 example(s), 0.5 MiB ...\n"
