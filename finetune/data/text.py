"""Text data for causal LMs from any source (see sources.py): plain text,
tokenized and cut into blocks, or instruction/chat data (see chat.py).

Tokenisation is batched with a fast tokenizer and cached by `datasets`; the
token stream is then cut into `block_size` blocks, as in transformers' run_clm
example.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict, load_dataset
from datasets.distributed import split_dataset_by_node
from datasets.utils import logging as datasets_logging
from transformers import PreTrainedTokenizerBase

from finetune.data import builtin
from finetune.data.builtin import build_stdlib_corpus, build_stdlib_questions
from finetune.data.chat import EXAMPLE_NUMBER, detect_format
from finetune.data.formats import FORMATS, SFT_FORMATS
from finetune.data.locations import TEXT_FILES
from finetune.data.mixture import Source, is_held_out
from finetune.data.sources import (HELD_OUT_SPLITS, limit_samples, load_source, named_split, root_cause,
                                   train_and_held_out, train_split)
from finetune.errors import UsageError


def _builtin_text() -> DatasetDict:
    return load_dataset("json", data_files=str(build_stdlib_corpus()))


def _builtin_chat() -> DatasetDict:
    return load_dataset("json", data_files=str(build_stdlib_questions()))


def _builtin(data_format: str) -> Callable[[], DatasetDict]:
    """The embedded default in a data format: its rows in that format, or the stdlib's docstrings as text."""
    if data_format not in FORMATS:
        return _builtin_text
    build = getattr(builtin, FORMATS[data_format].builtin)
    return lambda: load_dataset("json", data_files=str(build()))


def load_raw_data(dataset: str, data_format: str, text_column: str, validation_split: float, seed: int, *,
                  config: str = "", split: str = "", eval_split: str = "",
                  sample_by: str = "paragraph", objective: str = "sft") -> tuple[DatasetDict, str]:
    """`train` and `validation` splits, and the data format they are in. The
    embedded default is plain text, or its rows in the format asked for.
    `config`, `split` and `eval_split`: see sources.py; `sample_by`: what one
    document of a .txt file is (see `_txt_options`); `objective`: the --method
    the rows are for (errors name it)."""
    raw = load_source(dataset, _builtin(data_format), TEXT_FILES, f"{'/'.join(TEXT_FILES)} files", config,
                      _txt_options(sample_by))
    data_format = detect_format(train_split(raw, split).column_names, data_format, text_column, dataset, objective)
    if data_format == "text":
        return _text_splits(raw, dataset, text_column, validation_split, seed, split, eval_split), data_format
    if len(train_split(raw, split)) == 0:
        raise UsageError(f"--dataset {dataset} holds no examples; give it some rows")
    raw = DatasetDict({name: rows.add_column(EXAMPLE_NUMBER, list(range(1, len(rows) + 1)))
                       for name, rows in raw.items()})
    return train_and_held_out(raw, validation_split, seed, split, eval_split), data_format


def load_raw_text(dataset: str, text_column: str, validation_split: float, seed: int, *, config: str = "",
                  split: str = "", eval_split: str = "", sample_by: str = "paragraph") -> DatasetDict:
    """A DatasetDict with `train` and `validation` splits and a single `text` column."""
    raw = load_source(dataset, _builtin_text, TEXT_FILES, f"{'/'.join(TEXT_FILES)} files", config,
                      _txt_options(sample_by))
    return _text_splits(raw, dataset, text_column, validation_split, seed, split, eval_split)


def _txt_options(sample_by: str) -> dict[str, dict]:
    """A .txt file is prose wrapped at some width, so by default a document is
    a paragraph: the text between blank lines, its line breaks kept (as
    `datasets`' text builder samples by paragraph). `line` makes every line a
    document, without its line break; `document` makes the whole file one."""
    return {"text": {"sample_by": sample_by, "keep_linebreaks": sample_by != "line"}}


def _text_splits(raw: DatasetDict, dataset: str, text_column: str, validation_split: float, seed: int,
                 split: str, eval_split: str) -> DatasetDict:
    columns = train_split(raw, split).column_names
    if text_column not in columns:
        raise UsageError(f"--dataset {dataset} has no column {text_column!r} (columns: {', '.join(columns)}); "
                         "pass --text_column with the right name")
    feature = train_split(raw, split).features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        kind = getattr(feature, "dtype", None) or type(feature).__name__.lower()
        raise UsageError(f"--dataset {dataset}: column {text_column!r} holds {kind} values, not text; pass "
                         "--text_column with the text, or --data_format chat/instruction for conversations")
    raw = DatasetDict({name: split.select_columns([text_column]).rename_column(text_column, "text")
                       if text_column != "text" else split.select_columns(["text"]) for name, split in raw.items()})
    if train_split(raw, split).info.builder_name == "text":
        # A .txt paragraph keeps the blank lines beyond the one that ended the
        # one before it at its edges; no document keeps them.
        raw = raw.map(lambda batch: {"text": [t.strip("\n") for t in batch["text"]]}, batched=True,
                      desc="trimming blank lines")
    raw = raw.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True)
    if len(train_split(raw, split)) == 0:
        raise UsageError(f"--dataset {dataset} holds no text; give it some non-empty documents")
    return train_and_held_out(raw, validation_split, seed, split, eval_split)


def tokenize_and_group(raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, block_size: int,
                       num_proc: int = 0) -> DatasetDict:
    """Token blocks of exactly `block_size` ids, an end-of-text token between documents."""
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in tokenizer(batch["text"])["input_ids"]]}

    def group(batch):
        stream = [t for ids in batch["input_ids"] for t in ids]
        usable = len(stream) // block_size * block_size
        return {"input_ids": [stream[i:i + block_size] for i in range(0, usable, block_size)]}

    tokens = raw.map(tokenize, batched=True, remove_columns=["text"], desc="tokenizing", num_proc=num_proc or None)
    blocks = tokens.map(group, batched=True, batch_size=1000, desc=f"grouping into blocks of {block_size}")
    for name, split in blocks.items():
        if len(split) == 0:
            count = sum(len(ids) for ids in tokens[name]["input_ids"])
            # A held-out share too small to make one block: the split is the cause, not the block.
            fix = ("hold out more (a larger --validation_split, or a larger held-out split of the data) or lower "
                   "--block_size" if name == "validation" else "add text, hold out less (a smaller --validation_split) or lower "
                   "--block_size")
            raise UsageError(f"the {name} text has {count} tokens, fewer than one block of --block_size {block_size}; "
                             f"{fix}")
    return blocks.with_format("torch")


def text_iterator(split: Dataset, batch_size: int = 1000):
    """Batches of the split's text, for training a tokenizer: the text column,
    or every string of an SFT example (chat turns' content included)."""
    for start in range(0, len(split), batch_size):
        batch = split[start:start + batch_size]
        if "text" in batch:
            yield batch["text"]
        else:
            yield [text for column in batch.values() for value in column for text in _strings(value)]


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    return []


# --- mixtures and streams (the rows themselves: mixture.py) ---------------------------------------

STREAM_EVAL_ROWS = 200   # held-out examples read from a stream when --max_eval_samples is 0
TOKENIZER_SAMPLE_ROWS = 2000  # examples per source a preset's tokenizer is trained on, with --streaming


@dataclass
class LoadedSources:
    sources: list[Source]
    validation: list[list[dict]]  # each source's held-out raw rows
    sample: Dataset               # text to train a preset's tokenizer on (empty unless asked for)


def load_sources(cfg, rank: int, world_size: int, tokenizer_sample: bool = False) -> LoadedSources:
    """Every --dataset source, with its format, its training rows (this rank's
    part of a stream) and its held-out rows. A stream's held-out rows are its
    validation split's first ones, else those a hash of their content holds
    out (--validation_split of them), which training then skips."""
    sources, validation, sample = [], [], []
    for name, weight in zip(cfg.sources, cfg.source_weights):
        if cfg.streaming:
            source, held_out, every_rank = _streamed_source(cfg, name, weight, rank, world_size)
        else:
            raw, data_format = load_raw_data(name, cfg.data_format, cfg.text_column, cfg.validation_split, cfg.seed,
                                             config=cfg.dataset_config, split=cfg.dataset_split,
                                             eval_split=cfg.eval_split, sample_by=cfg.text_sample_by)
            raw = limit_samples(raw, cfg.max_train_samples, cfg.max_eval_samples)
            source = Source(name, weight, data_format, lambda train=raw["train"]: train)
            held_out, every_rank = list(raw["validation"]), raw["train"]
        if source.data_format == "preference":
            raise UsageError(f"--dataset {name} holds preference pairs (chosen/rejected), which a mixture does not "
                             "train on; train --method dpo on it alone")
        sources.append(source)
        validation.append(held_out)
        if tokenizer_sample:
            sample += [text for row in itertools.islice(readable(every_rank, name), TOKENIZER_SAMPLE_ROWS)
                       for text in _strings(row)]
    return LoadedSources(sources, validation, Dataset.from_dict({"text": sample}))


def _streamed_source(cfg, name: str, weight: float, rank: int,
                     world_size: int) -> tuple[Source, list[dict], IterableDataset]:
    """The source (this rank's part), its held-out rows, and its training rows of every rank."""
    # A file that cannot be parsed is reported in one line of ours (readable,
    # RowStream), naming the fix; datasets' own log line would come first.
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    builtin = _builtin_chat if cfg.data_format in SFT_FORMATS else _builtin_text
    raw = load_source(name, builtin, TEXT_FILES, f"{'/'.join(TEXT_FILES)} files (or .gz/.zst)", cfg.dataset_config,
                      _txt_options(cfg.text_sample_by), streaming=True)
    train = train_split(raw, cfg.dataset_split)
    raw, train = _images_as_stored(raw), _images_as_stored(train)
    first = _first_row(train, name)
    data_format = detect_format(list(first), cfg.data_format, cfg.text_column, name)
    text_column = cfg.text_column
    if data_format == "text":
        if not isinstance(first.get(text_column), str):
            raise UsageError(f"--dataset {name}: column {text_column!r} holds {type(first.get(text_column)).__name__} "
                             "values, not text; pass --text_column with the text, or --data_format chat/instruction "
                             "for conversations")
        if getattr(train.info, "builder_name", None) == "text":  # a .txt paragraph's blank lines, as _text_splits
            raw = IterableDatasetDict({split: rows.map(lambda row: {text_column: row[text_column].strip("\n")})
                                       for split, rows in raw.items()})
            train = train_split(raw, cfg.dataset_split)
    held_out_split = (named_split(raw, cfg.eval_split, "--eval_split") if cfg.eval_split else next(
        (raw[split] for split in HELD_OUT_SPLITS if split in raw and split != (cfg.dataset_split or "train")), None))
    fraction = 0.0 if held_out_split is not None else cfg.validation_split
    if held_out_split is not None:
        rows = held_out_split
    else:  # a fraction of 0 (`finetune evaluate` scoring the split itself): its first rows
        rows = (row for row in train if fraction == 0 or is_held_out(row, fraction))
    held_out = list(itertools.islice(readable(rows, name), cfg.max_eval_samples or STREAM_EVAL_ROWS))
    source = Source(name, weight, data_format, lambda: split_dataset_by_node(train, rank=rank, world_size=world_size),
                    text_column=text_column, held_out=fraction)
    return source, held_out, train


def _images_as_stored(rows):
    """Image columns as their stored bytes and paths, not decoded: a row's
    digest (held out or not, the chunk a resume reads again) is of its content,
    and the collator decodes the images when it makes a batch."""
    from datasets import Image

    if isinstance(rows, IterableDatasetDict):
        return IterableDatasetDict({split: _images_as_stored(part) for split, part in rows.items()})
    for name, feature in (rows.features or {}).items():
        inner = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)  # a list
        if isinstance(feature, Image) or isinstance(inner, Image):
            rows = rows.cast_column(name, [Image(decode=False)] if inner is not None else Image(decode=False))
    return rows


def readable(rows, name: str):
    """`rows`, with a file that cannot be parsed as one line that names it."""
    try:
        yield from rows
    except Exception as e:  # datasets raises many types for a file it cannot parse
        raise UsageError(f"could not read --dataset {name} ({type(e).__name__}: {root_cause(e)}); fix or remove "
                         "the damaged file") from None


def _first_row(rows, name: str) -> dict:
    first = next(readable(rows, name), None)
    if first is None:
        raise UsageError(f"--dataset {name} holds no examples; give it some rows")
    return first
