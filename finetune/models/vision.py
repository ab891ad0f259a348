"""Where a vision-language model keeps its parts: each family names its
vision tower and its projector (from image features to the language model)
its own way."""

from __future__ import annotations

import torch

VISION_TOWERS = ("vision_tower", "vision_model", "visual", "vision_encoder", "image_encoder")
PROJECTORS = ("multi_modal_projector", "connector", "merger", "mm_projector", "embed_vision")


def part_named(model: torch.nn.Module, names: tuple[str, ...]) -> tuple[str | None, torch.nn.Module | None]:
    """The first module whose own name is one of `names`, and its full name; (None, None) where none is."""
    return next(((name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in names),
                (None, None))
