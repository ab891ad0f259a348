"""The fine-tuning methods (`--peft`): a full fine-tune, LoRA, QLoRA. A new
method is a module with a subclass of finetune/peft/base.py's FullFineTune
and a line here."""

from __future__ import annotations

from pathlib import Path

from finetune.peft.base import FullFineTune
from finetune.peft.lora import LoRA
from finetune.peft.qlora import QLoRA

REGISTRY: dict[str, type[FullFineTune]] = {method.name: method for method in (
    FullFineTune,
    LoRA,
    QLoRA,
)}


def method_for(cfg) -> FullFineTune:
    """The method a run's config asks for (`--peft`)."""
    return REGISTRY[cfg.peft](cfg)


def method_of_checkpoint(model_files: Path) -> FullFineTune:
    """The method whose files a checkpoint's model_config/ holds; a full
    fine-tune's when no other's (LoRA and QLoRA checkpoints are alike)."""
    return next((method() for method in REGISTRY.values() if method.wrote(model_files)), FullFineTune())
