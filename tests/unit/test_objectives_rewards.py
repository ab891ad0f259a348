"""Reward functions (finetune/objectives/rewards.py): the built-ins, loading
the user's by file or module, and what a returned value may be."""

from __future__ import annotations

import math
import sys

import pytest

from finetune.errors import UsageError
from finetune.objectives.rewards import (absolute_reward, check_reward_files, is_user_code, load_reward_functions,
                                         score)


def test_the_built_ins_check_the_answer_the_pattern_and_the_length():
    functions = load_reward_functions(["exact_match", "format", "length_penalty"], r"[a-z.]+", 8)
    completions = ["`json.decoder`.", "The json module", [{"role": "assistant", "content": " JSON "}]]
    table = score(functions, ["q"] * 3, completions, [[1, 2], [1, 2, 3, 4], [5]],
                  {"answer": ["json.decoder", "json", "json"]})
    assert [row[0] for row in table] == [1.0, 0.0, 1.0]  # backticks, a full stop, case and spaces aside
    assert [row[1] for row in table] == [0.0, 0.0, 0.0] and \
        score(functions[1:2], ["q"], ["json.decoder"], [[1]], {})[0] == [1.0]
    assert [row[2] for row in table] == [-2 / 8, -4 / 8, -1 / 8]
    with pytest.raises(UsageError, match="'answer' column"):
        score(functions[:1], ["q"], ["x"], [[1]], {})


def test_a_users_function_by_file_or_module_and_what_it_may_return(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("def odd(prompts, completions, completion_ids, **kw):\n"
                                      "    return [True, None, 2]\n")
    by_file = load_reward_functions([f"{tmp_path / 'mine.py'}:odd"], "", 8)
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = load_reward_functions(["mine:odd"], "", 8)
    for functions in (by_file, by_module):
        assert functions[0].name == "odd" and functions[0].user_code
        table = score(functions, ["q"] * 3, ["a", "b", "c"], [[1]] * 3, {})
        assert table[0] == [1.0] and math.isnan(table[1][0]) and table[2] == [2.0]  # a bool counts; None: n/a
    sys.modules.pop("mine", None)
    assert not is_user_code("format") and is_user_code("mine:odd")


def test_what_can_be_said_before_anything_is_imported(tmp_path, monkeypatch):
    for spec, says in (("rewards.py", "neither a built-in"), ("x.py:1bad", "neither a built-in"),
                       (f"{tmp_path}/missing.py:f", "missing.py does not exist")):
        with pytest.raises(UsageError, match=says):
            check_reward_files([spec])
    for name in ("r.py", "other.py"):
        (tmp_path / name).write_text("def f(prompts, completions, completion_ids, **kw):\n    return []\n")
    monkeypatch.chdir(tmp_path)
    assert absolute_reward("r.py:f") == f"{tmp_path}/r.py:f" and absolute_reward("exact_match") == "exact_match"
    with pytest.raises(UsageError, match="names f twice"):
        load_reward_functions(["r.py:f", "other.py:f"], "", 8)
