"""Text data for causal LMs through `datasets`: load, split, tokenize, group.

Sources: a Hub dataset id, a local .txt/.jsonl/.json/.parquet file or a dir of
them, or `builtin` (the embedded default). Tokenisation is batched with a fast
tokenizer and cached by `datasets`; the token stream is then cut into
`block_size` blocks, as in transformers' run_clm example.
"""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset, DatasetDict, load_dataset
from transformers import PreTrainedTokenizerBase

from finetune.data.builtin import build_stdlib_corpus
from finetune.errors import UsageError

LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _local_data_files(path: Path) -> tuple[str, list[str]]:
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_BUILDERS and p.is_file())
        if not files:
            raise UsageError(f"--dataset {path} holds no {'/'.join(LOCAL_BUILDERS)} files; point it at a data file or a dir of them")
    builders = {LOCAL_BUILDERS.get(p.suffix) for p in files}
    if None in builders:
        raise UsageError(f"--dataset {path}: unsupported file type {path.suffix!r}; use one of {', '.join(LOCAL_BUILDERS)}")
    if len(builders) > 1:
        raise UsageError(f"--dataset {path} mixes file types ({', '.join(sorted(builders))}); keep one type per dir")
    empty = [p for p in files if p.stat().st_size == 0]
    if len(empty) == len(files):
        raise UsageError(f"--dataset {path} is empty; give it some text")
    return builders.pop(), [str(p) for p in files if p.stat().st_size > 0]


def load_raw_text(dataset: str, text_column: str, validation_split: float, seed: int) -> DatasetDict:
    """A DatasetDict with `train` and `validation` splits and a single `text` column."""
    if dataset == "builtin":
        raw = load_dataset("json", data_files=str(build_stdlib_corpus()))
    elif Path(dataset).exists():
        builder, files = _local_data_files(Path(dataset))
        try:
            # A dir with train*/validation* files keeps its splits (datasets' own naming rules).
            raw = load_dataset(builder, data_dir=dataset) if Path(dataset).is_dir() else load_dataset(builder, data_files=files)
        except Exception as e:  # datasets raises many types for unreadable files
            raise UsageError(f"could not read --dataset {dataset} as {builder} ({type(e).__name__}); check the file format") from None
    elif dataset.startswith((".", "/", "~")) or dataset.endswith(tuple(LOCAL_BUILDERS)):
        raise UsageError(f"--dataset {dataset} does not exist; pass an existing file or dir, a Hub id, or 'builtin'")
    else:
        try:
            raw = load_dataset(dataset)
        except Exception as e:
            raise UsageError(f"could not load Hub dataset {dataset!r} ({type(e).__name__}); "
                             "check the id and the network, or pass a local file or 'builtin'") from None

    train = raw["train"] if "train" in raw else raw[next(iter(raw))]
    if text_column not in train.column_names:
        raise UsageError(f"--dataset {dataset} has no column {text_column!r} (columns: {', '.join(train.column_names)}); "
                         "pass --text_column with the right name")
    raw = DatasetDict({name: split.select_columns([text_column]).rename_column(text_column, "text")
                       if text_column != "text" else split.select_columns(["text"]) for name, split in raw.items()})
    raw = raw.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True)
    train = raw["train"] if "train" in raw else raw[next(iter(raw))]
    if len(train) == 0:
        raise UsageError(f"--dataset {dataset} holds no text; give it some non-empty documents")

    held_out = [raw[name] for name in ("validation", "test") if name in raw and len(raw[name]) > 0]
    if held_out:
        return DatasetDict(train=train, validation=held_out[0])
    if len(train) < 2:
        return DatasetDict(train=train, validation=train)  # one document: evaluate on what we train on
    split = train.train_test_split(test_size=validation_split, seed=seed)
    return DatasetDict(train=split["train"], validation=split["test"])


def tokenize_and_group(raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, block_size: int) -> DatasetDict:
    """Token blocks of exactly `block_size` ids, an end-of-text token between documents."""
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in tokenizer(batch["text"])["input_ids"]]}

    def group(batch):
        stream = [t for ids in batch["input_ids"] for t in ids]
        usable = len(stream) // block_size * block_size
        return {"input_ids": [stream[i:i + block_size] for i in range(0, usable, block_size)]}

    tokens = raw.map(tokenize, batched=True, remove_columns=["text"], desc="tokenizing")
    counts = {name: sum(len(ids) for ids in split["input_ids"]) for name, split in tokens.items()}
    blocks = tokens.map(group, batched=True, batch_size=1000, desc=f"grouping into blocks of {block_size}")
    for name, split in blocks.items():
        if len(split) == 0:
            raise UsageError(f"the {name} text has {counts[name]} tokens, fewer than one block of --block_size {block_size}; "
                             "add text or lower --block_size")
    return blocks.with_format("torch")


def text_iterator(split: Dataset, batch_size: int = 1000):
    for start in range(0, len(split), batch_size):
        yield split[start:start + batch_size]["text"]
