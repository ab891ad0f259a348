"""Where data comes from, with one rule for every task: `builtin` (the task's
embedded default), a local file or dir, or a Hub dataset id; then which split
trains and which is held out for evaluation.

text.py and images.py turn what this returns into token blocks or pixels.
"""

from __future__ import annotations

import codecs
import math
import re
import warnings
from pathlib import Path
from typing import Callable, Iterator

from datasets import Dataset, DatasetDict, IterableDatasetDict, load_dataset
from datasets.data_files import SPLIT_KEYWORDS
from datasets.utils import logging as datasets_logging

from finetune.data.locations import COMPRESSIONS, data_suffix, locate
from finetune.errors import UsageError

# Held-out splits a dataset may bring, in the order they are preferred.
HELD_OUT_SPLITS = ("validation", "test")


def load_source(dataset: str, builtin: Callable[[], DatasetDict], file_builders: dict[str, str],
                accepted: str, config: str = "", builder_options: dict[str, dict] | None = None,
                streaming: bool = False) -> DatasetDict | IterableDatasetDict:
    """`file_builders` maps the file suffixes a task reads to `datasets`
    builders, and `builder_options` a builder to its options for local files
    (the text builder's `sample_by`); `accepted` names them for error messages;
    `config` names one of a dataset's configurations (a Hub dataset's, or those
    a local dir's README.md dataset card declares). `streaming`: iterable
    splits that read their files only as they are iterated."""
    where = locate(dataset, file_builders)
    if where.kind == "builtin":
        return builtin().to_iterable_dataset() if streaming else builtin()
    if where.kind == "card":
        return _load(dataset, config, f"--dataset {dataset}", streaming)
    if where.kind == "hub":
        return _load(dataset, config, f"Hub dataset {dataset!r}", streaming)
    if config:
        raise UsageError(f"--dataset {dataset} has no configurations (no README.md dataset card declares any); "
                         "drop --dataset_config")
    return _load_local(dataset, list(where.files), file_builders, accepted, builder_options or {}, streaming)


def split_of(file: Path) -> str:
    """The split a file's name gives it, by datasets' own keywords
    (train-00001.jsonl, valid.parquet, ...); train when it names none."""
    for split, keywords in SPLIT_KEYWORDS.items():
        if re.search(rf"(^|[-._ 0-9])({'|'.join(keywords)})([-._ 0-9]|$)", file.name.lower()):
            return str(split)
    return "train"


def _load(dataset: str, config: str, what: str, streaming: bool = False) -> DatasetDict | IterableDatasetDict:
    """load_dataset, with the library's own reason (the list of configs, ...) in the one-line error."""
    try:
        return load_dataset(dataset, name=config or None, streaming=streaming)
    except Exception as e:  # datasets raises many types for unreachable or unknown ids and configs
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        fix = ("pass one with --dataset_config" if "onfig" in reason
               else "check the id and the network, or pass a local file or dir, or 'builtin'")
        raise UsageError(f"could not load {what} ({type(e).__name__}: {reason}); {fix}") from None


def _load_local(dataset: str, files: list[Path], file_builders: dict[str, str], accepted: str,
                builder_options: dict[str, dict], streaming: bool) -> DatasetDict | IterableDatasetDict:
    path = Path(dataset)
    if path.is_file() and data_suffix(path) not in file_builders:
        raise UsageError(f"--dataset {path}: unsupported file type {data_suffix(path)!r}; use {accepted}")
    if not files:
        raise UsageError(f"--dataset {path} holds no {accepted}; point it at a data file or a dir of them")
    builders = {file_builders.get(data_suffix(p), data_suffix(p)) for p in files}
    if len(builders) > 1:
        raise UsageError(f"--dataset {path} mixes file types ({', '.join(sorted(builders))}); keep one type per "
                         "dir or pattern")
    if all(p.stat().st_size == 0 for p in files):
        raise UsageError(f"--dataset {path} is empty; give it some data")
    builder = builders.pop()
    if builder not in file_builders.values():
        raise UsageError(f"--dataset {path}: unsupported file type {builder!r}; use {accepted}")
    if builder in ("json", "text", "csv") and not streaming:  # a stream's bad bytes are found as it is read
        for file in files:
            check_utf8(file, "--dataset")
    if any(file.suffix.lower() == ".zst" for file in files):
        try:
            import zstandard  # noqa: F401  datasets opens .zst files with it
        except ImportError:
            raise UsageError(f"--dataset {path} holds .zst files, which need the zstandard package: pip install "
                             "'finetune[zst]'") from None
    # The reader logs its own error line before ours: its reason goes into ours instead.
    verbosity = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    try:
        # A dir or a pattern keeps the splits its file names give (train*, validation*, test*: datasets' own rules).
        options = builder_options.get(builder, {})
        if path.is_dir():
            return load_dataset(builder, data_dir=str(path), streaming=streaming, **options)
        splits: dict[str, list[str]] = {}
        for file in files:
            splits.setdefault(split_of(file) if len(files) > 1 else "train", []).append(str(file))
        return load_dataset(builder, data_files=splits, streaming=streaming, **options)
    except Exception as e:  # datasets raises many types for unreadable files
        raise UsageError(f"could not read --dataset {path} as {builder} ({root_cause(e)}); "
                         "check the file format") from None
    finally:
        datasets_logging.set_verbosity(verbosity)


def root_cause(error: BaseException) -> str:
    """The innermost cause's first line (datasets wraps the reader's own reason)."""
    while (inner := error.__cause__ or error.__context__) is not None and inner is not error:
        error = inner
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def decompressed_chunks(path: Path, size: int = 1 << 22) -> Iterator[bytes]:
    """The file's content in chunks, through the decompressor its suffix names;
    nothing more once an archive turns out damaged, or needs a decompressor
    this Python lacks (datasets' reader then says which)."""
    suffix = path.suffix.lower()
    try:
        if suffix not in COMPRESSIONS:
            f = path.open("rb")
        elif suffix == ".zst":
            import zstandard

            f = zstandard.ZstdDecompressor().stream_reader(path.open("rb"), closefd=True)
        else:
            import bz2
            import gzip
            import lzma

            f = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[suffix](path, "rb")
        with f:
            while chunk := f.read(size):
                yield chunk
    except (ImportError, EOFError, OSError, ValueError, RuntimeError):
        if suffix not in COMPRESSIONS:
            raise
        return


def check_utf8(path: Path, option: str) -> None:
    """Text files are read as UTF-8; a byte that is not would surface later as
    a traceback from inside the reader. Checked in chunks (about 1 GB/s), a
    compressed file's content as it decompresses."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    for chunk in decompressed_chunks(path):
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError as e:
            where = f"at byte offset {offset + e.start}: {e.object[e.start]:#04x}"
            if path.suffix.lower() in COMPRESSIONS:
                raise UsageError(f"{option} {path} is not UTF-8 text ({where} of its content); decompress it, "
                                 "convert it to UTF-8 (iconv -f latin1 -t utf-8 if it is Latin-1) and compress it "
                                 "again") from None
            raise UsageError(f"{option} {path} is not UTF-8 text ({where}); convert it to UTF-8, e.g. iconv -f "
                             f"latin1 -t utf-8 {path} > {path.with_name(path.stem + '.utf8' + path.suffix)} if it "
                             "is Latin-1") from None
        offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise UsageError(f"{option} {path} is not UTF-8 text (it ends inside a character); convert it to UTF-8 "
                         "or complete the file") from None


def named_split(raw: DatasetDict, name: str, option: str) -> Dataset:
    if name not in raw:
        raise UsageError(f"{option} {name!r} is not a split of the data (its splits: {', '.join(raw)}); pass one of them")
    return raw[name]


def train_split(raw: DatasetDict, name: str = "") -> Dataset:
    """The split named, else `train`, else the first."""
    if name:
        return named_split(raw, name, "--dataset_split")
    return raw["train"] if "train" in raw else raw[next(iter(raw))]


def train_and_held_out(raw: DatasetDict, validation_split: float, seed: int, train_name: str = "",
                       eval_name: str = "") -> DatasetDict:
    """`train` and `validation`: the split named by `eval_name`, else the data's
    own held-out split when it has one, else a `validation_split` fraction of
    the training samples (the same ones for the same seed); a `validation_split`
    of 0 (`finetune evaluate`) holds out nothing and evaluates the whole
    training split. With a single sample there is nothing to hold out, so it is
    evaluated on as well, and a warning says so."""
    train = train_split(raw, train_name)
    held_out = named_split(raw, eval_name, "--eval_split") if eval_name else next(
        (raw[name] for name in HELD_OUT_SPLITS if name in raw and len(raw[name]) > 0 and raw[name] is not train), None)
    if held_out is not None:
        return DatasetDict(train=train, validation=held_out)
    if validation_split == 0:
        return DatasetDict(train=train, validation=train)
    if len(train) < 2:
        warnings.warn("the data holds a single sample: nothing can be held out, so evaluation uses the training "
                      "data; add samples or a validation split for a real held-out score", stacklevel=2)
        return DatasetDict(train=train, validation=train)
    held_out_count = math.ceil(validation_split * len(train))  # as train_test_split rounds
    if held_out_count >= len(train):
        raise UsageError(f"--validation_split {validation_split} of {len(train)} samples holds out every one of "
                         "them, leaving none to train on; lower --validation_split or add data")
    split = train.train_test_split(test_size=validation_split, seed=seed)
    return DatasetDict(train=split["train"], validation=split["test"])


def limit_samples(raw: DatasetDict, max_train: int, max_eval: int) -> DatasetDict:
    """The first `max_train` training and `max_eval` held-out samples (0 = all)."""
    limits = {"train": max_train, "validation": max_eval}
    return DatasetDict({name: split.select(range(min(limits.get(name, 0), len(split)))) if limits.get(name) else split
                        for name, split in raw.items()})
