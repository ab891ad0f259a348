"""The embedded default text: docstrings of the Python standard library.

Real English prose about programming, present on every machine that runs this
package, read with `ast` (nothing is imported or executed) and deterministic for
a given Python version. It is built at run time into a cache and never
committed.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
from pathlib import Path

# Test suites, GUI tools and vendored code hold little prose.
SKIP_DIRS = {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__",
             "turtledemo", "ensurepip", "tkinter"}
MIN_CHARS = 80


def cache_root() -> Path:
    return Path(os.environ.get("FINETUNE_CACHE", Path.home() / ".cache" / "finetune"))


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    docs = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= MIN_CHARS:
            docs.append(doc)
    return docs


def stdlib_python_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def build_stdlib_corpus() -> Path:
    """Write (once) and return a .jsonl file with one docstring per line."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    target = cache_root() / "builtin" / f"stdlib-docstrings-py{version}.jsonl"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w") as out:
        for path in stdlib_python_files():
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            for doc in _docstrings(source):
                out.write(json.dumps({"text": doc}) + "\n")
    os.replace(tmp, target)  # atomic: concurrent builders write the same content
    return target
