"""Unit tests of the built-in corpus."""

from __future__ import annotations

import json


def test_builtin_corpus_is_real_text_and_deterministic(tmp_path, monkeypatch):
    from finetune.data.builtin import build_stdlib_corpus

    built = []
    for cache in ("first", "second"):  # two independent builds, nothing shared
        monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / cache))
        built.append(build_stdlib_corpus())
    assert built[0] != built[1] and built[0].read_bytes() == built[1].read_bytes()
    docs = [json.loads(line)["text"] for line in built[0].read_text().splitlines()]
    assert len(docs) > 1000 and sum(map(len, docs)) > 500_000
    words = " ".join(docs[:200]).split()
    assert sum(w.lower() in {"the", "a", "of", "is", "to"} for w in words) > 0.05 * len(words)
    import argparse

    assert argparse.__doc__.strip() in docs  # module docstrings are read from the source files


def test_definitions_are_found_in_ast_walks_order():
    """The corpus's order is ast.walk's: every definition, however nested
    (methods, functions in try/except/else/finally, with, match and loops),
    and none more."""
    import ast
    import inspect

    from finetune.data import builtin

    source = '''
class A:
    def m(self):
        def inner(): pass
        return lambda: 0
    class B:
        async def n(self): pass
try:
    def t(): pass
except ValueError:
    def e(): pass
else:
    def el(): pass
finally:
    def f(): pass
with open("x") as h:
    def w(): pass
match 1:
    case 1:
        def c(): pass
for i in range(2):
    if i:
        def loop(): pass
    else:
        class Other: pass
while False:
    def wl(): pass
'''
    for tree in (ast.parse(source), ast.parse(inspect.getsource(ast))):
        walked = [n for n in ast.walk(tree) if isinstance(n, builtin.DEFINITIONS)]
        assert builtin._definitions(tree) == walked and len(walked) > 10
