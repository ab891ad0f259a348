"""Reward functions for online RL, with TRL's signature:

    f(prompts, completions, completion_ids, **columns) -> list[float | None]

`prompts` and `completions` are strings, or message lists for conversational
prompts (a completion is then `[{"role": "assistant", "content": ...}]`);
every other column of the data arrives as a keyword argument, one value per
completion. `None` means "not applicable to this completion".

A reward named FILE.py:NAME or module:NAME is the user's own code: it is
imported only because the command line names it (never because a run config
records it). The built-ins check what a string can: the answer column, a
pattern, the length.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from finetune.data.fingerprint import reward_file
from finetune.errors import UsageError, not_a_file
from finetune.stopping import stop_requested

BUILTIN_NAMES = ("exact_match", "format", "length_penalty")


def completion_text(completion: Any) -> str:
    """A completion's text: itself, or its messages' contents."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return str(completion)


def normalised(text: str) -> str:
    """Compared without surrounding space, quotes, backticks or a final full stop."""
    return text.strip(" \t\r\n`'\".").lower()


def exact_match(prompts, completions, completion_ids, answer=None, **_) -> list[float]:
    """1 when the completion is the row's `answer` (spaces, quotes, backticks
    and a final full stop aside, any case), else 0."""
    if answer is None:
        raise UsageError("the built-in reward exact_match compares each completion with the data's 'answer' column, "
                         "which this data lacks; add an answer column, or choose another reward")
    return [float(normalised(completion_text(c)) == normalised(str(a))) for c, a in zip(completions, answer)]


def format_reward(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)

    def format(prompts, completions, completion_ids, **_) -> list[float]:  # noqa: A001  (its metric name)
        """1 when the whole completion (stripped) matches --reward_pattern, else 0."""
        return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]

    return format


def length_penalty_reward(max_completion_length: int) -> Callable:
    def length_penalty(prompts, completions, completion_ids, **_) -> list[float]:
        """-(completion tokens) / --max_completion_length: shorter is better, from -1 to 0."""
        return [-len(ids) / max_completion_length for ids in completion_ids]

    return length_penalty


@dataclass
class RewardFunction:
    name: str       # its metric name: rewards/<name>/mean
    spec: str       # as the command line gave it
    function: Callable

    @property
    def user_code(self) -> bool:
        return is_user_code(self.spec)


def is_user_code(spec: str) -> bool:
    return spec not in BUILTIN_NAMES and not is_reward_model(spec)


def is_reward_model(spec: str) -> bool:
    """A --reward_funcs entry that names a model dir: a reward model's scores, no code of its own run."""
    return ":" not in spec and (Path(spec) / "config.json").is_file()


def check_reward_model(spec: str) -> None:
    """A reward model's dir, from its config.json alone: a sequence classifier with one score."""
    import json

    where = Path(spec) / "config.json"
    try:
        config = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"--reward_funcs {spec}: {where} is not a readable JSON config ({e}); pass a reward model's "
                         "dir") from None
    architectures = config.get("architectures") or [] if isinstance(config, dict) else []
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2) if isinstance(config, dict) else 0
    classifier = any(str(a).endswith("ForSequenceClassification") for a in architectures)
    if not classifier or labels != 1:
        saved_as = ", ".join(map(str, architectures)) or "no architecture"
        scores = f" with {labels} labels" if classifier else ""
        raise UsageError(f"--reward_funcs {spec} is a model dir of {saved_as}{scores}, not a reward model (a sequence "
                         "classifier with one score); train one with --method reward, or name a reward function")


def absolute_reward(spec: str) -> str:
    """FILE.py:NAME with the file's absolute path (a reward model's dir, absolute), so
    that a resume from another dir reads the same file."""
    if is_reward_model(spec):
        return str(Path(spec).absolute())
    path = reward_file(spec)
    return f"{path.absolute()}:{spec.rpartition(':')[2]}" if path is not None and path.exists() else spec


def check_reward_files(specs: Sequence[str]) -> None:
    """What can be said of --reward_funcs without importing anything: the form, and that a file exists."""
    for spec in specs:
        if spec in BUILTIN_NAMES:
            continue
        if is_reward_model(spec):
            check_reward_model(spec)
            continue
        where, _, name = spec.rpartition(":")
        if not where or not name.isidentifier():
            raise UsageError(f"--reward_funcs {spec!r} is neither a built-in ({', '.join(BUILTIN_NAMES)}) nor "
                             "FILE.py:NAME or module:NAME; name the function after a colon, e.g. rewards.py:correct")
        path = reward_file(spec)
        if path is not None and not path.is_file():
            raise UsageError(f"--reward_funcs {spec}: {path} {not_a_file(path)}; pass the path of your reward file")


def load_reward_functions(specs: Sequence[str], pattern: str, max_completion_length: int) -> list[RewardFunction]:
    """Each --reward_funcs entry as a function, or a one-line error naming it."""
    functions = []
    for spec in specs:
        if spec == "exact_match":
            function: Callable = exact_match
        elif spec == "format":
            try:
                function = format_reward(pattern)
            except re.error as e:
                raise UsageError(f"--reward_pattern {pattern!r} is not a regular expression ({e}); fix it") from None
        elif spec == "length_penalty":
            function = length_penalty_reward(max_completion_length)
        elif is_reward_model(spec):
            check_reward_model(spec)
            function = reward_model_scores(spec)
        else:
            function = _user_function(spec)
        name = (spec if spec in BUILTIN_NAMES else Path(spec).name if is_reward_model(spec)
                else spec.rpartition(":")[2])
        if any(f.name == name for f in functions):
            raise UsageError(f"--reward_funcs names {name} twice; give each function once (weigh it with "
                             "--reward_weights)")
        functions.append(RewardFunction(name, spec, function))
    return functions


def reward_model_scores(path: str) -> Callable:
    """A reward model's score of each prompt and completion, as TRL scores them:
    the conversation through the model's chat template, or the prompt's text
    then the completion's. Its weights only: trust_remote_code stays off. A
    copy on each rank, in float32, without gradients."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.models import check_model_files

    check_model_files(Path(path), f"--reward_funcs {path}")  # whole safetensors files, never a pickle
    model = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=False,
                                                               dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id  # the head pools at the last token that is not padding
    tokenizer.padding_side = "right"

    def scores(prompts, completions, completion_ids, **_) -> list[float]:
        texts = [tokenizer.apply_chat_template(p + c, tokenize=False) if isinstance(p, list) else p + completion_text(c)
                 for p, c in zip(prompts, completions)]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            return model(**batch).logits[:, 0].float().tolist()

    scores.__name__ = Path(path).name
    return scores


def _user_function(spec: str) -> Callable:
    check_reward_files([spec])
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where)
        module_name = f"finetune_reward_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001  (the user's code: any error is theirs to fix)
            raise UsageError(f"--reward_funcs {spec}: importing {path} raised {type(e).__name__}: "
                             f"{_first_line(e)}; fix the file") from None
        sys.modules[module_name] = module
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise UsageError(f"--reward_funcs {spec}: no module {where} can be imported ({_first_line(e)}); pass "
                             "FILE.py:NAME for a file, or install the module") from None
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"--reward_funcs {spec}: importing {where} raised {type(e).__name__}: "
                             f"{_first_line(e)}; fix the module") from None
    function = getattr(module, name, None)
    if function is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UsageError(f"--reward_funcs {spec}: {where} defines no {name} (it defines: {', '.join(defined) or 'none'}); "
                         "fix the name after the colon")
    if not callable(function):
        raise UsageError(f"--reward_funcs {spec}: {name} in {where} is a {type(function).__name__}, not a function; "
                         "name a function")
    return function


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


# A reward beyond this overflows the float32 sums of a group's mean and std.
LARGEST_REWARD = 1e30
# A reward still running this long after a stop signal is not waited for.
STOP_GRACE_S = 10.0


def score(functions: list[RewardFunction], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], timeout_s: float = 0.0) -> list[list[float]]:
    """[completion][function] rewards, NaN where a function returned None.
    Each function gets its own copies of the inputs (what it changes in them
    reaches neither the next function nor completions.jsonl); one that raises,
    exits, hangs past `timeout_s` (0: no limit) or returns something else stops
    the run in one line."""
    table = [[math.nan] * len(functions) for _ in completions]
    for j, reward in enumerate(functions):
        inputs = copy.deepcopy({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                                **columns})
        values = _call(reward, inputs, timeout_s)
        if not isinstance(values, (list, tuple)) and not hasattr(values, "tolist"):
            raise UsageError(f"reward function {reward.spec} returned a {type(values).__name__}, not a list of "
                             f"numbers; return one float (or None) per completion")
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        if len(values) != len(completions):
            raise UsageError(f"reward function {reward.spec} returned {len(values)} rewards for {len(completions)} "
                             "completions; return one float (or None) per completion")
        for i, value in enumerate(values):
            if value is not None:
                table[i][j] = _reward_value(value, reward.spec, i)
    return table


def _reward_value(value: Any, spec: str, i: int) -> float:
    """A reward as a float: Python, numpy and 0-d torch numbers (bools count as 0/1)."""
    if not isinstance(value, numbers.Real) and hasattr(value, "item") and tuple(getattr(value, "shape", (1,))) == ():
        value = value.item()  # a numpy scalar or 0-d array, a 0-d tensor
    if not isinstance(value, numbers.Real):
        raise UsageError(f"reward function {spec} returned {value!r} for completion {i}; rewards must be finite "
                         "numbers (or None where the function does not apply)")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or abs(number) > LARGEST_REWARD:
        shown = f"{value!r}" if len(repr(value)) < 40 else f"a number of {len(str(value))} digits"
        raise UsageError(f"reward function {spec} returned {shown} for completion {i}; rewards must be finite "
                         f"numbers within +-{LARGEST_REWARD:g} (scale them down), or None where the function does "
                         "not apply")
    return number


def _call(reward: RewardFunction, inputs: dict, timeout_s: float) -> Any:
    """The function's return value (awaited, for an `async def`), called in a
    thread of its own so that a call that never returns ends the run in one
    line after `timeout_s`, or soon after a stop signal."""
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            values = reward.function(**inputs)
            if inspect.isawaitable(values):
                values = asyncio.run(_awaited(values))
            outcome["values"] = values
        except BaseException as e:  # noqa: BLE001  (the user's code: sys.exit and all)
            outcome["error"] = e

    thread = threading.Thread(target=call, name=f"reward {reward.name}", daemon=True)
    started = time.monotonic()
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        waited = time.monotonic() - started
        if thread.is_alive() and timeout_s and waited > timeout_s:
            raise UsageError(f"reward function {reward.spec} did not return within {timeout_s:g} s "
                             "(--reward_timeout); the last complete checkpoint is kept: fix the function (or raise "
                             "--reward_timeout), then resume")
        if thread.is_alive() and (signal_name := stop_requested(longer_than_s=STOP_GRACE_S)):
            raise UsageError(f"{signal_name} arrived while reward function {reward.spec} was running "
                             f"({waited:.0f} s so far); stopped without a new checkpoint (the last complete one "
                             "is kept)")
    if "error" in outcome:
        e = outcome["error"]
        if isinstance(e, UsageError):
            raise e
        if isinstance(e, SystemExit):
            raise UsageError(f"reward function {reward.spec} called sys.exit({e.code!r}); a reward function "
                             "cannot end the run: return its rewards, or raise an exception with a message") from None
        raise UsageError(f"reward function {reward.spec} raised {type(e).__name__}: {_first_line(e)}; fix it "
                         "(it is called with prompts, completions, completion_ids and the data's other columns "
                         "as keyword arguments)") from None
    return outcome["values"]


async def _awaited(awaitable):
    return await awaitable
