"""A byte-level BPE tokenizer (GPT-2's scheme) trained on the run's own text,
for models built from scratch."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable

import datasets
import tokenizers
from datasets import Dataset
from datasets.fingerprint import Hasher
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from finetune.data.text import text_iterator

EOS = "<|endoftext|>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS,
                                   model_max_length=1 << 30)


TRAINER_VERSION = Hasher.hash([train_bpe_tokenizer.__code__, tokenizers.__version__])  # a new trainer, a new cache


def save_bpe_tokenizer(train: Dataset, vocab_size: int, tokenizer_dir: Path) -> None:
    """A tokenizer trained on `train`'s text, saved in `tokenizer_dir`.

    Training is deterministic, so it is kept next to datasets' caches, keyed by
    the split's fingerprint, the vocabulary size and this trainer, and a later
    run on the same text copies it instead of training again (half a second
    of every preset run's start-up on the built-in corpus)."""
    key = Hasher.hash([train._fingerprint, vocab_size, TRAINER_VERSION])
    cached = Path(datasets.config.HF_DATASETS_CACHE) / "finetune_tokenizers" / key
    if not (cached / "tokenizer.json").is_file():
        tokenizer = train_bpe_tokenizer(text_iterator(train), vocab_size)
        try:
            tmp = cached.with_name(f".{key}.tmp-{os.getpid()}")
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, cached)  # whole or not at all; a concurrent run's copy is as good
        except OSError:  # a read-only or full cache: train every time
            shutil.rmtree(tmp, ignore_errors=True)
            tokenizer.save_pretrained(tokenizer_dir)
            return
    shutil.copytree(cached, tokenizer_dir, dirs_exist_ok=True)


def load_preset_tokenizer(tokenizer_dir: Path, preset: str) -> PreTrainedTokenizerBase:
    """A run's own tokenizer, named by its preset rather than by the run dir it
    was saved in: datasets fingerprints the tokenizer, its path included, and
    the same tokenizer must find the same tokenised data in the cache."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    tokenizer.name_or_path = tokenizer.init_kwargs["name_or_path"] = preset
    return tokenizer
