"""The objective registry: what the loss learns from (`--method`), by name.

Each objective is a class in its own module that owns its options, data
format, loss, reference, learning rates and planner rule (base.py says what
it answers); adding one means that module, imported and named below.
Families share a Task: the preference pairs' (pairs.py) and the rollouts'
(rollouts.py). Light on purpose: the config and the command line read it
without importing torch.
"""

from __future__ import annotations

import importlib

from finetune.objectives import dpo, grpo, kto, orpo, reward_model, rloo, sft, simpo
from finetune.objectives.base import Objective
from finetune.options import readers

REGISTRY: dict[str, Objective] = {module.OBJECTIVE.name: module.OBJECTIVE for module in (
    sft, dpo, simpo, orpo, kto, grpo, rloo, reward_model,
)}

OBJECTIVES = tuple(REGISTRY)
DEFAULT = "sft"

# Each option an objective reads -> the objectives that read it (the others refuse it).
READERS = readers({name: type(objective).sections() for name, objective in REGISTRY.items()})
SECTIONS = tuple(dict.fromkeys(section for objective in REGISTRY.values() for section in type(objective).sections()))


def recorded_objective(config: dict) -> str:
    """The objective a recorded run config names (`method:` before it was `objective:`)."""
    return str(config.get("objective") or config.get("method") or DEFAULT)


def build_task(cfg):
    """The run's Task (finetune/tasks/base.py): its objective's, or the task's own for SFT."""
    from finetune.tasks import REGISTRY as TASKS

    objective = REGISTRY[cfg.objective]
    module, name = (objective.task_classes.get(cfg.task) or objective.task_class or TASKS[cfg.task].task_class).split(":")
    return getattr(importlib.import_module(module), name)(cfg)
