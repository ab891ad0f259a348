"""The embedded defaults, built from the docstrings of the Python standard
library: plain text (every docstring), and for instruction tuning questions
about public functions and classes ("What does `json.dumps` do?") answered by
the first paragraph of their docstrings.

Real English prose about programming, present on every machine that runs this
package, read with `ast` (nothing is imported or executed) and deterministic for
a given Python version. They are built at run time into a cache and never
committed.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
from collections import deque
from pathlib import Path
from typing import Callable, Iterator

# Test suites, GUI tools and vendored code hold little prose.
SKIP_DIRS = {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__",
             "turtledemo", "ensurepip", "tkinter"}
MIN_CHARS = 80
# Answers: a sentence or a short paragraph.
MIN_ANSWER_CHARS, MAX_ANSWER_CHARS = 40, 400


def cache_root() -> Path:
    return Path(os.environ.get("FINETUNE_CACHE", Path.home() / ".cache" / "finetune"))


DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
HOLDS_STATEMENTS = (ast.stmt, ast.excepthandler, ast.match_case)


def _definitions(tree: ast.Module) -> list[ast.AST]:
    """The classes and functions of `tree` in `ast.walk`'s order (breadth
    first, fields in order), walking only the nodes that can hold statements:
    a definition is never inside an expression, and the expressions are most
    of the tree (ast.walk took 5x as long)."""
    found, todo = [], deque([tree])
    while todo:
        node = todo.popleft()
        if isinstance(node, DEFINITIONS):
            found.append(node)
        for field in node._fields:
            children = getattr(node, field, None)
            if isinstance(children, list):
                todo.extend(child for child in children if isinstance(child, HOLDS_STATEMENTS))
    return found


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + _definitions(tree)
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


def _sources() -> Iterator[tuple[Path, str]]:
    for path in stdlib_python_files():
        try:
            yield path, path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def _write_once(name: str, rows: Callable[[], Iterator[dict]]) -> Path:
    """Write (once) and return a .jsonl file of `rows` in the cache."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    target = cache_root() / "builtin" / f"{name}-py{version}.jsonl"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w") as out:
        for row in rows():
            out.write(json.dumps(row) + "\n")
    os.replace(tmp, target)  # atomic: concurrent builders write the same content
    return target


def build_stdlib_corpus() -> Path:
    """One docstring per line, as {"text": ...}."""
    return _write_once("stdlib-docstrings", lambda: ({"text": doc} for _, source in _sources()
                                                      for doc in _docstrings(source)))


def _module_name(path: Path) -> str | None:
    """`json.decoder` for .../json/decoder.py; None for private modules."""
    parts = list(path.relative_to(sysconfig.get_paths()["stdlib"]).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if not parts or any(p.startswith("_") for p in parts):
        return None
    return ".".join(parts)


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.split("\n\n")[0].split())


def _public_definitions() -> Iterator[tuple[str, ast.ClassDef | ast.FunctionDef]]:
    """(module, node) of every public module-level function and class of the public stdlib modules."""
    for path, source in _sources():
        module = _module_name(path)
        if module is None:
            continue
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_"):
                yield module, node


def _questions() -> Iterator[dict]:
    seen = set()
    for module, node in _public_definitions():
        doc = ast.get_docstring(node, clean=True)
        answer = _first_paragraph(doc) if doc else ""
        name = f"{module}.{node.name}"
        if not MIN_ANSWER_CHARS <= len(answer) <= MAX_ANSWER_CHARS or name in seen:
            continue
        seen.add(name)
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        yield {"messages": [{"role": "user", "content": f"What does the Python {kind} `{name}` do?"},
                            {"role": "assistant", "content": answer}]}




def build_stdlib_questions() -> Path:
    """Questions about public stdlib functions and classes, answered by the
    first paragraph of their docstrings, as {"messages": [user, assistant]}."""
    return _write_once("stdlib-questions", _questions)


def _preferences() -> Iterator[dict]:
    """Each question answered right (chosen) and with the answer of a question
    half the list away (rejected): fluent, on topic in form, and wrong."""
    rows = [json.loads(line) for line in build_stdlib_questions().read_text().splitlines()]
    for i, row in enumerate(rows):
        question, answer = row["messages"]
        other = rows[(i + len(rows) // 2) % len(rows)]["messages"][1]
        if other["content"] != answer["content"]:
            yield {"prompt": [question], "chosen": [answer], "rejected": [other]}


def build_stdlib_preferences() -> Path:
    """The built-in questions as preference pairs: {"prompt": [user],
    "chosen": [the docstring's answer], "rejected": [another function's]}."""
    return _write_once("stdlib-preferences", _preferences)


def _unpaired() -> Iterator[dict]:
    """Each preference pair as two labelled completions: the right answer
    desirable, another question's answer undesirable."""
    for row in map(json.loads, build_stdlib_preferences().read_text().splitlines()):
        yield {"prompt": row["prompt"], "completion": row["chosen"], "label": True}
        yield {"prompt": row["prompt"], "completion": row["rejected"], "label": False}


def build_stdlib_unpaired() -> Path:
    """The built-in questions as KTO's unpaired completions: {"prompt": [user],
    "completion": [an answer], "label": whether it is the docstring's}."""
    return _write_once("stdlib-unpaired", _unpaired)


def _module_questions() -> Iterator[dict]:
    """Names defined at the top of exactly one public stdlib module, asked for
    that module: an answer a reward can check by string match."""
    homes: dict[str, set[str]] = {}
    for module, node in _public_definitions():
        homes.setdefault(node.name, set()).add(module)
    for name, modules in sorted(homes.items()):
        if len(modules) == 1:
            module = next(iter(modules))
            yield {"prompt": [{"role": "user", "content": f"Which Python standard library module defines `{name}`? "
                                                          "Answer with the module's name only."}],
                   "answer": module}


def build_stdlib_module_questions() -> Path:
    """Prompts for online RL (--method grpo): {"prompt": [user], "answer":
    module}, "Which module defines `X`?" for every name only one module defines."""
    return _write_once("stdlib-module-questions", _module_questions)
