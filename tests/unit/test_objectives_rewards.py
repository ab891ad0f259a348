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


def _functions(tmp_path, body: str, name: str = "r") -> list:
    """A user's reward file holding `body` (its imports and functions), loaded as --reward_funcs FILE.py:NAME."""
    path = tmp_path / f"{name}_{abs(hash(body))}.py"
    path.write_text(body)
    return load_reward_functions([f"{path}:{name}"], "", 8)


def test_a_function_gets_copies_and_its_count_is_held_against_what_was_sent(tmp_path):
    """A reward that pops a completion, clears its list or edits the prompts
    changes nothing the run keeps, and is held to one reward per completion sent."""
    mutating = _functions(tmp_path, "def r(prompts, completions, completion_ids, **kw):\n"
                                    "    prompts[0] = 'edited'; completion_ids[0].clear()\n"
                                    "    out = [1.0] * len(completions); completions.pop(); return out[:len(completions)]\n")
    prompts, completions, ids = ["p", "q"], ["a", "b"], [[1, 2], [3]]
    with pytest.raises(UsageError, match="returned 1 rewards for 2 completions"):
        score(mutating, prompts, completions, ids, {})
    assert (prompts, completions, ids) == (["p", "q"], ["a", "b"], [[1, 2], [3]])
    clearing = _functions(tmp_path, "def r(prompts, completions, completion_ids, answer, **kw):\n"
                                    "    n = len(completions); answer.clear(); completions.clear(); return [0.5] * n\n")
    columns = {"answer": ["x", "y"]}
    assert score(clearing, prompts, completions, ids, columns) == [[0.5], [0.5]] and columns == {"answer": ["x", "y"]}


def test_numpy_and_0d_torch_numbers_count_and_what_does_not_fit_a_float32_is_refused(tmp_path):
    import numpy as np
    import torch

    kinds = _functions(tmp_path, "import numpy as np, torch\n"
                                 "def r(prompts, completions, completion_ids, **kw):\n"
                                 "    return [np.float32(0.5), np.int64(2), torch.tensor(1.5), np.bool_(True), np.array(3.0)]\n")
    assert score(kinds, ["p"] * 5, ["c"] * 5, [[1]] * 5, {}) == [[0.5], [2.0], [1.5], [1.0], [3.0]]
    assert score(_functions(tmp_path, "import numpy as np\ndef r(prompts, completions, completion_ids, **kw):\n"
                                      "    return np.array([1.0, 0.0])\n"), ["p"] * 2, ["c"] * 2, [[1]] * 2, {}) \
        == [[1.0], [0.0]]
    for value, says in (("1e308", "within"), ("10 ** 400", "a number of 401 digits"), ("float('nan')", "finite"),
                        ("torch.tensor([1.0])", "finite numbers"), ("'1.0'", "finite numbers")):
        bad = _functions(tmp_path, f"import torch\ndef r(prompts, completions, completion_ids, **kw):\n"
                                   f"    return [{value}]\n")
        with pytest.raises(UsageError, match=says):
            score(bad, ["p"], ["c"], [[1]], {})
    assert torch.finfo(torch.float32).max > 1e30 and np.isfinite(np.float32(1e30) * 64)  # a group's sums still fit


def test_user_code_cannot_end_the_run_hang_it_or_warn_of_an_unawaited_coroutine(tmp_path, recwarn):
    for code, says in (("sys.exit(0)", r"called sys.exit\(0\); a reward function cannot end the run"),
                       ("sys.exit(3)", r"sys.exit\(3\)"), ("raise KeyError('k')", "raised KeyError: 'k'")):
        exiting = _functions(tmp_path, f"import sys\ndef r(prompts, completions, completion_ids, **kw):\n    {code}\n")
        with pytest.raises(UsageError, match=says):
            score(exiting, ["p"], ["c"], [[1]], {})
    stuck = _functions(tmp_path, "import time\ndef r(prompts, completions, completion_ids, **kw):\n"
                                 "    time.sleep(60)\n")
    with pytest.raises(UsageError, match=r"did not return within 0.3 s \(--reward_timeout\)"):
        score(stuck, ["p"], ["c"], [[1]], {}, timeout_s=0.3)
    awaited = _functions(tmp_path, "import asyncio\nasync def r(prompts, completions, completion_ids, **kw):\n"
                                   "    await asyncio.sleep(0)\n    return [0.25 for _ in completions]\n")
    assert score(awaited, ["p", "q"], ["c", "d"], [[1], [2]], {}) == [[0.25], [0.25]]
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


def test_a_stop_signal_does_not_wait_on_a_stuck_reward(tmp_path, monkeypatch):
    import signal

    from finetune import objectives
    from finetune.objectives import rewards
    from finetune.stopping import StopSignals

    monkeypatch.setattr(rewards, "STOP_GRACE_S", 0.2)
    stuck = _functions(tmp_path, "import time\ndef r(prompts, completions, completion_ids, **kw):\n"
                                 "    time.sleep(60)\n")
    with StopSignals() as stop:
        stop._handle(signal.SIGTERM, None)
        with pytest.raises(UsageError, match="SIGTERM arrived while reward function .* was running"):
            score(stuck, ["p"], ["c"], [[1]], {}, timeout_s=0)
    assert "grpo" in objectives.READERS["reward_timeout"]
