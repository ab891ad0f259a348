"""A model dir's safetensors index, read without torch (the checks before
the libraries load use it too)."""

from __future__ import annotations

import json
from pathlib import Path

from finetune.errors import UsageError

SAFETENSORS_INDEX = "model.safetensors.index.json"


def indexed_files(model_dir: Path) -> list[Path]:
    """The weight files a model dir's index names: file names in that dir
    only. The index may come from anyone; a path in it (absolute, ../) would
    have weights read from anywhere."""
    index = model_dir / SAFETENSORS_INDEX
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise UsageError(f"{index} is not a safetensors index (a JSON weight_map of tensor names to file names); "
                         "write the model dir again with save_pretrained") from None
    for name in sorted(names, key=str):
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise UsageError(f"{index} names the weight file {str(name)[:120]!r}, which is not a file in "
                             f"{model_dir}; an index names the files beside it: fix it, or write the model dir again")
    return sorted(model_dir / name for name in names)


def missing_weight_files(model_dir: Path, what: str) -> None:
    """One line when the index names a weight file the dir does not hold."""
    if not (model_dir / SAFETENSORS_INDEX).is_file():
        return
    if missing := [file.name for file in indexed_files(model_dir) if not file.is_file()]:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UsageError(f"{what}: its {SAFETENSORS_INDEX} names {', '.join(missing[:3])}{more}, which "
                         f"{'is' if len(missing) == 1 else 'are'} not in {model_dir}; copy or download the model "
                         "dir whole")
