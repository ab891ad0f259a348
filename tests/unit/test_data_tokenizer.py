"""Unit tests of the presets' tokenizer."""

from __future__ import annotations

import pytest
from datasets import Dataset, DatasetDict

from finetune.data.text import tokenize_and_group
from finetune.data.tokenizer import train_bpe_tokenizer


def test_a_preset_tokenizer_is_trained_once_per_text_and_its_tokens_cached_across_run_dirs(tmp_path, monkeypatch):
    import datasets

    import finetune.data.tokenizer as tokenizer_module
    from finetune.data.tokenizer import load_preset_tokenizer, save_bpe_tokenizer

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    texts = [f"document {i} says alpha beta gamma {i * 7} delta" for i in range(300)]
    DatasetDict(train=Dataset.from_dict({"text": texts}),
                validation=Dataset.from_dict({"text": texts[:20]})).save_to_disk(tmp_path / "raw")
    raw = datasets.load_from_disk(str(tmp_path / "raw"))  # file-backed: maps write cache files

    save_bpe_tokenizer(raw["train"], 320, tmp_path / "run_a" / "tokenizer")

    def no_training(*args, **kwargs):
        raise AssertionError("trained again")
    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", no_training)
    save_bpe_tokenizer(raw["train"], 320, tmp_path / "run_b" / "tokenizer")  # the same text: from the cache
    trained = train_bpe_tokenizer(texts, 320)
    trained.save_pretrained(tmp_path / "fresh")
    for run in ("run_a", "run_b"):
        assert (tmp_path / run / "tokenizer" / "tokenizer.json").read_text() == \
            (tmp_path / "fresh" / "tokenizer.json").read_text()
    with pytest.raises(AssertionError, match="trained again"):
        save_bpe_tokenizer(raw["train"], 330, tmp_path / "run_c" / "tokenizer")  # another vocabulary size
    with pytest.raises(AssertionError, match="trained again"):
        save_bpe_tokenizer(raw["train"].select(range(100)), 320, tmp_path / "run_c" / "tokenizer")  # other text

    # The second run dir's tokenizer finds the first one's tokens in datasets' cache.
    blocks = [tokenize_and_group(raw, load_preset_tokenizer(tmp_path / run / "tokenizer", "tiny-gpt2"), 16)
              for run in ("run_a", "run_b")]
    assert blocks[0]["train"].cache_files and blocks[0]["train"].cache_files == blocks[1]["train"].cache_files
    assert blocks[0]["train"]["input_ids"][:3].tolist() == blocks[1]["train"]["input_ids"][:3].tolist()
