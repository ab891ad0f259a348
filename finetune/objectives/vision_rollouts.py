"""GRPO and RLOO on prompts with images (`--task image-text-to-text --method
grpo`): TRL's prompt-only rows with an images column. Each prompt batch is
rendered by the model's processor, left-padded for generation, with its
image tensors (data/vision.py's VisionPromptCollator); `generate` is given
them, and so is every forward that scores the completions. Reward functions
get the rows' images decoded (PIL), as TRL's get a dataset's Image column."""

from __future__ import annotations

import torch

from finetune.data.chat import EXAMPLE_NUMBER
from finetune.data.vision import IMAGE_COLUMNS, TOKEN_KEYS, VisionPromptCollator, image_token_ids, open_image
from finetune.objectives.rollouts import RolloutLM
from finetune.tasks.vision_language import VisionLanguageLM

PROMPT_KEYS = ("prompt_ids", "prompt_mask", "row")  # a prompt batch's own; the rest are the processor's


class VisionRolloutLM(RolloutLM, VisionLanguageLM):
    formats = ("prompt",)
    collator = VisionPromptCollator
    rows_are = "prompts"
    builtin = "prompts.jsonl"
    prompts_have_images = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.image_keys: set[str] = set()  # what the processor adds to a prompt batch, once one is seen

    def _rows(self):
        """The prompt rows, numbered across both splits (`row`: what a rollout's completions point back to)."""
        raw, root, description, data_format = super()._rows()
        numbered = {}
        for name, split in raw.items():
            start = len(self.rows)
            self.rows.extend({k: v for k, v in row.items() if k != EXAMPLE_NUMBER} for row in split)
            numbered[name] = split.add_column("row", list(range(start, len(self.rows))))
        # Reward functions get completions as messages where the prompts are messages (TRL's rule).
        self.conversational = isinstance(self.rows[0]["prompt"], list)
        return type(raw)(numbered), root, description, data_format

    def _collate(self, data_format: str, tokenizer, copies: int = 0) -> VisionPromptCollator:
        cfg = self.cfg
        return self.collator(self.processor, cfg.block_size - cfg.max_completion_length, self.image_root,
                             copies or cfg.num_generations)

    def never_sampled(self) -> tuple[int, ...]:
        """The image placeholders: one in a completion would ask the next forward for an image it was not given."""
        return image_token_ids(self.processor)

    def prompt_inputs(self, prompts: dict) -> dict:
        return {k: v for k, v in prompts.items() if k not in PROMPT_KEYS}

    def with_prompt_inputs(self, batch: dict, prompts: dict) -> dict:
        """The prompts' image tensors (per image or per row, in the rows'
        order) as they are; per-token ones (Gemma 3's token types) moved from
        the left-padded prompt onto the prompt + completion rows, 0 past the
        prompt. No position ids: Qwen-VL's are 3-D, from the image grids, and
        the others count from 0 as the model does on right-padded rows."""
        batch.pop("position_ids", None)
        device, mask = batch["input_ids"].device, prompts["prompt_mask"].bool().cpu()
        for key, value in self.prompt_inputs(prompts).items():
            self.image_keys.add(key)
            if key in TOKEN_KEYS:
                per_token = torch.zeros_like(batch["input_ids"], dtype=value.dtype)
                for i, row in enumerate(value.cpu()):
                    kept = row[mask[i]]
                    per_token[i, :len(kept)] = kept.to(device)
                value = per_token
            batch[key] = value.to(device)
        return batch

    def saved_batch(self, batch: dict) -> dict:
        """Without the image tensors: `restored_batch` makes them again from the rows."""
        return {k: v for k, v in batch.items() if k not in self.image_keys}

    def restored_batch(self, batch: dict) -> dict:
        prompts = self._collate("prompt", None, copies=1)([{**self.rows[r], "row": r} for r in batch["row"].tolist()])
        return self.with_prompt_inputs(batch, prompts)

    def inputs(self, model, batch: dict) -> dict:
        """The tokens, their mask and the image tensors (not the rollout's advantages and log-probs)."""
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False,
                **{k: batch[k] for k in self.image_keys if k in batch}}

    def reward_columns(self, values: list[dict]) -> dict[str, list]:
        """The rows' columns, their images decoded (PIL), as TRL's reward functions get an Image column."""
        columns = super().reward_columns(values)
        for name in IMAGE_COLUMNS:
            if name in columns:
                columns[name] = [self._decoded(value) for value in columns[name]]
        return columns

    def _decoded(self, value):
        if value is None:
            return None
        if isinstance(value, (list, tuple)):
            return [open_image(ref, self.image_root, "a reward function's image") for ref in value]
        return open_image(value, self.image_root, "a reward function's image")
