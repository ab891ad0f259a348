"""`finetune evaluate MODEL --tasks ...`: benchmark scores from
lm-evaluation-harness (`pip install 'finetune[lm-eval]'`) on a model dir (an
export, a run's final/), through lm-eval's own `hf` model with the batch size,
dtype and device chosen here. Offline, a local task dir (`--tasks_dir`) works,
and one task ships with the package: `finetune_stdlib_qa`
(finetune/lm_eval_tasks), multiple choice on the built-in questions a run
holds out.

The results go into the model dir (lm_eval_results.json, and its model card)
and, for a run's final/, into the run's summary.json (`lm_eval`). A .gguf
model (a base the quickstart fetches) is scored as its converted dir.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from finetune.errors import UsageError, first_line
from finetune.hardware import cpu_has_native_bf16
from finetune.model_card import CARD, LM_EVAL_RESULTS, refresh_model_card
from finetune.model_dir import is_own_file, replace_file
from finetune import json_text

SHIPPED_TASKS = Path(__file__).parent / "lm_eval_tasks"


def chosen_dtype(device: str) -> str:
    """bf16 where the hardware computes it natively, else float32 (what HF loads)."""
    native = device == "cuda" and torch.cuda.is_bf16_supported() or device == "cpu" and cpu_has_native_bf16()
    return "bfloat16" if native else "float32"


def task_manager(tasks_dir: str | None):
    from lm_eval.tasks import TaskManager

    include = [str(SHIPPED_TASKS)]
    if tasks_dir:
        if not Path(tasks_dir).is_dir():
            raise UsageError(f"--tasks_dir {tasks_dir} is not a directory; pass the dir holding your task YAML files")
        include.append(str(Path(tasks_dir)))
    return TaskManager(include_path=include)


def check_task_names(names: list[str], manager) -> None:
    import difflib

    known = set(manager.all_tasks)
    unknown = [name for name in names if name not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=3)
        raise UsageError(f"--tasks: lm-eval knows no task {unknown[0]!r}"
                         + (f" (did you mean {', '.join(close)}?)" if close else "")
                         + "; name tasks lm-eval lists (`lm_eval ls tasks`), or pass --tasks_dir with your own")


def building_tasks(error: BaseException) -> bool:
    """Whether lm-eval failed while building the tasks (reading their YAML and
    data), not while scoring the model."""
    import traceback

    return any(frame.filename.endswith(("lm_eval/tasks/manager.py", "lm_eval/tasks/_factory.py"))
               for frame in traceback.extract_tb(error.__traceback__))


def check_model_dir(model_dir: Path) -> None:
    """What lm-eval will load, read first: a damaged file is one line here, not a traceback from inside lm-eval."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.models import check_model_files

    check_model_files(model_dir, str(model_dir))
    try:
        AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
        AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as e:  # TypeError: a tokenizer file of the wrong JSON shape
        raise UsageError(f"could not read the model in {model_dir} ({first_line(e)}); pass a whole model dir "
                         "(an export, a run's final/)") from None


def run_benchmarks(model_dir: str | Path, tasks: str, tasks_dir: str | None = None, batch_size: int = 8,
                   limit: int | None = None, num_fewshot: int | None = None) -> dict:
    """lm-eval's scores of the model dir on the comma-separated tasks, written next to the model."""
    try:
        import lm_eval
    except ImportError:
        raise UsageError("--tasks runs lm-evaluation-harness: pip install 'finetune[lm-eval]'") from None
    from finetune.models.gguf import converted_dir, is_gguf

    # A GGUF file is scored as its converted model dir (cached), and its scores only printed.
    gguf_file = is_gguf(str(model_dir))
    model_dir = converted_dir(str(model_dir)) if gguf_file else Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"{model_dir} is not a model dir (no config.json); pass an exported dir, a run's final/ "
                         "or a .gguf file")
    check_model_dir(model_dir)
    names = [name.strip() for name in tasks.split(",") if name.strip()]
    if not names:
        raise UsageError(f"--tasks {tasks!r} names no task; pass comma-separated lm-eval task names, e.g. "
                         "finetune_stdlib_qa or hellaswag,arc_easy")
    manager = task_manager(tasks_dir)
    check_task_names(names, manager)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = chosen_dtype(device)
    settings = {"model_dir": str(model_dir), "device": device, "dtype": dtype, "batch_size": batch_size,
                "limit": limit, "num_fewshot": num_fewshot, "lm_eval_version": lm_eval.__version__}
    try:
        out = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(model_dir), "dtype": dtype,
                                                              "trust_remote_code": False},
                                      tasks=names, batch_size=batch_size, device=device, limit=limit,
                                      num_fewshot=num_fewshot, task_manager=manager, log_samples=False)
    except Exception as e:  # noqa: BLE001  (a task's own YAML names its data: any failure there is the task's)
        if not building_tasks(e):
            raise
        raise UsageError(f"could not load the data of --tasks {tasks} ({type(e).__name__}: {first_line(e)}); check "
                         "the task's dataset_path and data_files (offline, its data must be local or in the "
                         "datasets cache)") from None
    scores = {task: {metric: value for metric, value in result.items() if metric != "alias"}
              for task, result in out["results"].items()}
    if gguf_file:
        return {"results": scores, **settings}
    record = read_results(model_dir)
    record["results"].update(scores)
    record["settings"].update({task: settings for task in scores})
    # Files of ours, each replaced whole: never written through a link that stands at its name.
    replace_file(model_dir / LM_EVAL_RESULTS, json_text.dumps(record, indent=2))
    if not refresh_model_card(model_dir) and (model_dir / CARD).exists():
        print(f"left {model_dir / CARD} as it is: it is not the card finetune wrote (the scores are in "
              f"{LM_EVAL_RESULTS})", file=sys.stderr)
    summary = model_dir.parent / "summary.json"
    if model_dir.name == "final" and is_own_file(summary):
        facts = json.loads(summary.read_text())
        facts["lm_eval"] = record["results"]
        replace_file(summary, json_text.dumps(facts, indent=2))
    return {"results": scores, **settings}


def read_results(model_dir: Path) -> dict:
    """Earlier scores of the dir (other tasks are kept; the same task's are replaced)."""
    try:
        if not is_own_file(model_dir / LM_EVAL_RESULTS):
            raise OSError("none, or a link")
        record = json.loads((model_dir / LM_EVAL_RESULTS).read_text())
    except (OSError, ValueError):
        record = {}
    if not isinstance(record, dict) or not isinstance(record.get("results"), dict):
        record = {}
    return {"results": record.get("results", {}), "settings": record.get("settings", {})}
