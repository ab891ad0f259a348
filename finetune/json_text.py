"""JSON as every reader takes it: a non-finite float (NaN, inf) becomes null,
never the `NaN` / `Infinity` that Python writes and strict readers (jq, a
browser, JSON Lines tools) refuse."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float inside it replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **options) -> str:
    return json.dumps(finite(value), allow_nan=False, **options)


def read_jsonl(path) -> list[dict]:
    """The rows of a JSON Lines file we wrote, without a line cut short by a
    kill mid-write (or any other line that is not a whole JSON object); none
    when the file is missing or unreadable."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
