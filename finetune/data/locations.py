"""What a --dataset value names, decided from the file system alone: the
task's embedded default, a dataset card's dir, local files, or a Hub id. Light
on purpose (no `datasets`): every rank runs it before the libraries load, so a
misspelt path ends in a second, and sources.py loads by the same rule."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import UsageError


def glob_matches(value: str) -> list[Path]:
    """The files a glob such as data/shard-*.jsonl.gz names, sorted (none for anything else)."""
    if not value or not any(c in value for c in "*?[") or Path(value).exists():
        return []
    return sorted(Path(p) for p in glob.glob(os.path.expanduser(value), recursive=True) if Path(p).is_file())


# Compressed data files are read through (datasets opens them by their suffix).
COMPRESSIONS = (".gz", ".zst", ".bz2", ".xz")

# The files each kind of data is read from, by suffix, and the datasets builder that reads them.
TEXT_FILES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# An image folder (one sub-directory per class) is read by datasets' imagefolder builder.
IMAGE_FILES = {".parquet": "parquet", **{suffix: "imagefolder" for suffix in IMAGE_SUFFIXES}}


@dataclass(frozen=True)
class Location:
    kind: str                      # "builtin", "card" (a dir with a dataset card), "files" or "hub"
    files: tuple[Path, ...] = ()   # kind "files": what it holds of the task's types


def locate(dataset: str, file_builders: dict[str, str]) -> Location:
    """Where `dataset` is, or one line saying why it is nowhere. `file_builders`:
    the suffixes the task reads (a dir keeps only those)."""
    if dataset == "builtin":
        return Location("builtin")
    path = Path(dataset)
    if path.is_dir() and (path / "README.md").is_file():  # a dataset card: datasets reads its configs and files
        check_card_stays_inside(path)
        return Location("card")
    if path.exists():
        return Location("files", (path,) if path.is_file() else tuple(sorted(
            p for p in path.rglob("*") if p.is_file() and data_suffix(p) in file_builders)))
    if matches := glob_matches(dataset):
        return Location("files", tuple(matches))
    if any(c in dataset for c in "*?["):
        raise UsageError(f"--dataset {dataset} matches no file; check the pattern (quote it so that the shell "
                         "leaves it to finetune)")
    if dataset.startswith((".", "/", "~")) or data_suffix(path) in file_builders:
        raise UsageError(f"--dataset {dataset} does not exist; pass an existing file or dir, a Hub id, or 'builtin'")
    return Location("hub")


def data_suffix(path: Path) -> str:
    """A data file's type: .jsonl for both x.jsonl and x.jsonl.gz."""
    suffixes = [s.lower() for s in path.suffixes]
    return suffixes[-2] if len(suffixes) > 1 and suffixes[-1] in COMPRESSIONS else path.suffix.lower()


def check_card_stays_inside(path: Path) -> None:
    """A dataset dir's card may name data files (`configs: data_files`): only
    paths inside the dir. Anything else (an absolute path, ../, a URL) would be
    read without being the dir the command line named, nor fingerprinted with
    it for a resume."""
    import yaml

    text = (path / "README.md").read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return
    try:
        card = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return  # datasets names what is wrong with it
    configs = card.get("configs") if isinstance(card, dict) else None
    for config in configs if isinstance(configs, list) else []:
        files = config.get("data_files") if isinstance(config, dict) else None
        for named in _named_paths(files):
            parts = Path(named).parts
            if Path(named).is_absolute() or ".." in parts or named.startswith("~") or "://" in named:
                raise UsageError(f"--dataset {path}: its README.md card names the data file {named[:120]!r}, outside "
                                 "the dir; a card names files inside its dir: move the data in, or pass the files "
                                 "as --dataset")


def _named_paths(files) -> list[str]:
    """The paths of a card's data_files: a path, a list of them, {split: paths} or [{split, path}]."""
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        return [p for key, value in files.items() if key != "split" for p in _named_paths(value)]
    if isinstance(files, list):
        return [p for item in files for p in _named_paths(item)]
    return []
