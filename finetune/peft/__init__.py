"""The PEFT registry (`--peft`): a full fine-tune, LoRA, QLoRA, by name, with
the option sections each reads and the learning rate it fine-tunes at.

A PEFT method is a subclass of base.py's FullFineTune in its own module,
named here by "module:Class" and loaded only when a run, an export or the
planner needs it. Light on purpose: the config and the command line read the
names and options without importing torch.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from finetune.errors import UsageError
from finetune.options import option, readers

if TYPE_CHECKING:
    from finetune.peft.base import FullFineTune


@dataclass
class LoRAOptions:
    """LoRA"""
    lora_r: int = option(8, "LoRA rank")
    lora_alpha: float = option(16.0, "LoRA scaling: the adapters' update is multiplied by lora_alpha / lora_r")
    lora_dropout: float = option(0.05, "dropout on the adapters' input while training")
    lora_target_modules: str = option("all-linear", "the modules that get adapters: all-linear (every linear layer "
                                      "but the output layer) or comma-separated module names (q_proj,v_proj; c_attn)")


def check_lora(cfg) -> None:
    if cfg.lora_r <= 0:
        raise UsageError(f"--lora_r must be > 0, got {cfg.lora_r}; pass a positive value")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise UsageError(f"--lora_dropout must be in [0, 1), got {cfg.lora_dropout}; pass e.g. 0.05")
    if not (cfg.lora_alpha > 0 and math.isfinite(cfg.lora_alpha)):
        raise UsageError(f"--lora_alpha must be a positive number, got {cfg.lora_alpha}; pass e.g. 16")
    if not cfg.lora_target_modules.strip(", "):
        raise UsageError("--lora_target_modules is empty; pass all-linear or module names such as q_proj,v_proj")


@dataclass(frozen=True)
class PeftEntry:
    name: str
    method_class: str                    # "module:Class" of its FullFineTune subclass
    summary: str                         # for --peft's help
    sections: tuple[type, ...] = ()      # the option sections it reads
    # The fine-tuning learning rate when it differs from a full fine-tune's (peft's and TRL's
    # usual LoRA rate: full fine-tuning's 5e-5 barely moves small adapters).
    learning_rate: float | None = None
    check: Callable[[object], None] = lambda cfg: None  # its options' values, in one-line errors

    @property
    def trains_adapters(self) -> bool:
        return self.learning_rate is not None

    def load_class(self) -> type[FullFineTune]:
        module, name = self.method_class.split(":")
        return getattr(importlib.import_module(module), name)


REGISTRY: dict[str, PeftEntry] = {entry.name: entry for entry in (
    PeftEntry("none", "finetune.peft.base:FullFineTune", "train every parameter"),
    PeftEntry("lora", "finetune.peft.lora:LoRA", "train LoRA adapters on a frozen base, through peft",
              (LoRAOptions,), 2e-4, check_lora),
    PeftEntry("qlora", "finetune.peft.qlora:QLoRA", "LoRA on a 4-bit base; GPUs only", (LoRAOptions,), 2e-4,
              check_lora),
)}

PEFT_METHODS = tuple(REGISTRY)
READERS = readers({name: entry.sections for name, entry in REGISTRY.items()})
SECTIONS = tuple(dict.fromkeys(section for entry in REGISTRY.values() for section in entry.sections))


def peft_for(cfg) -> FullFineTune:
    """The PEFT method a run's config asks for (`--peft`)."""
    return REGISTRY[cfg.peft].load_class()(cfg)


def peft_of_checkpoint(model_files: Path) -> FullFineTune:
    """The PEFT method whose files a checkpoint's model_config/ holds; a full
    fine-tune's when no other's (LoRA and QLoRA checkpoints are alike)."""
    classes = [entry.load_class() for entry in REGISTRY.values()]
    return next((method() for method in classes if method.wrote(model_files)), classes[0]())
