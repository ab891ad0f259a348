"""DPO on conversations about images (`--task image-text-to-text --method
dpo`): TRL's preference pairs (prompt, chosen, rejected) with an images
column, each side rendered with the pair's images by the model's processor
(data/vision.py), and pairs.py's losses, reference and metrics on them."""

from __future__ import annotations

from finetune.data.vision import VisionPairCollator
from finetune.objectives.pairs import PreferenceLM
from finetune.tasks.vision_language import VisionLanguageLM


class VisionPreferenceLM(PreferenceLM, VisionLanguageLM):
    formats = ("preference",)
    collator = VisionPairCollator
    rows_are = "pairs"
    builtin = "pairs.jsonl"
    _collate = VisionLanguageLM._collate  # the processor's batches, not PreferenceLM's of token ids
