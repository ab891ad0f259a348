"""GRPO's prompts with images: the prompt batches the processor makes (each
prompt a group's times, left-padded), the completion rows built on them, and
what reward functions get, on the tiny families' processors and models,
against each row run alone with transformers."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from finetune.config import TrainConfig
from finetune.data.shapes import build_shapes
from finetune.data.vision import VisionPromptCollator, image_token_ids
from finetune.errors import UsageError
from finetune.objectives.engines import Sampled
from finetune.objectives.vision_rollouts import VisionRolloutLM
from vlm_models import WITH_QWEN, IMAGE_TOKENS, save_vlm_model

GROUPS = 2


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> tuple[list[dict], Path]:
    """Two prompt rows of different lengths, numbered as the task numbers them."""
    data = build_shapes(cache=tmp_path_factory.mktemp("cache")).with_name("prompts.jsonl")
    rows = [json.loads(line) for line in data.read_text().splitlines()[:2]]
    rows[1]["prompt"][0]["content"].insert(0, {"type": "text", "text": "Look closely at this picture."})
    return [{**row, "row": i} for i, row in enumerate(rows)], data.parent


def alone(processor, row: dict, root: Path) -> dict:
    """The row's prompt as transformers renders and processes it, by itself."""
    text = processor.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    images = [[Image.open(root / name).convert("RGB") for name in row["images"]]]
    return processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")


def rollout_task(processor, rows: list[dict], root: Path) -> VisionRolloutLM:
    cfg = TrainConfig(task="image-text-to-text", objective="grpo", reward_funcs=["exact_match"],
                      num_generations=GROUPS, per_device_batch_size=2 * GROUPS, max_completion_length=4, block_size=128)
    task = VisionRolloutLM(cfg)
    task.processor, task.image_root, task.tokenizer = processor, root, processor.tokenizer
    task.accelerator = SimpleNamespace(device=torch.device("cpu"))
    task.rows = [{k: v for k, v in row.items() if k != "row"} for row in rows]
    task.conversational = True
    return task


@pytest.mark.parametrize("family", WITH_QWEN)
def test_each_prompt_is_its_groups_rows_and_samples_and_scores_as_it_does_alone(family, prompts, tmp_path):
    """Each prompt GROUPS times in a row, left-padded: the same tokens as the
    row processed alone, the same greedy answer from `generate` with the
    batch's image tensors, and the completion rows built on them score every
    token as the row alone does (Gemma 3's token types moved along)."""
    rows, root = prompts
    model_dir = save_vlm_model(tmp_path / family, family)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    task = rollout_task(processor, rows, root)
    batch = task._collate("prompt", processor.tokenizer)(rows)
    assert batch["row"].tolist() == [0, 0, 1, 1]
    assert (batch["prompt_mask"][:, -1] == 1).all() and (batch["prompt_mask"][:GROUPS, 0] == 0).all()  # left-padded
    never = image_token_ids(processor)
    assert set(processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKENS[family][:1])) <= set(never)
    with torch.no_grad():
        sampled = model.generate(input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"],
                                 **task.prompt_inputs(batch), max_new_tokens=4, do_sample=False,
                                 suppress_tokens=list(never))[:, batch["prompt_ids"].size(1):]
    completions = task._completion_batch(batch, Sampled(sampled))
    completions.pop("_rewards")
    with torch.no_grad():
        logits = model(**task.inputs(model, completions)).logits
    for i, row in enumerate(r for r in rows for _ in range(GROUPS)):
        own = alone(processor, row, root)
        length = int(own["attention_mask"].sum())
        assert batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist() == own["input_ids"][0].tolist()
        with torch.no_grad():
            theirs = model.generate(**own, max_new_tokens=4, do_sample=False, suppress_tokens=list(never))
        assert sampled[i].tolist() == theirs[0, length:].tolist()
        whole = {**own, "input_ids": theirs, "attention_mask": torch.ones_like(theirs)}
        for key in ("token_type_ids", "mm_token_type_ids"):  # per token: 0 over the answer
            if key in own:
                whole[key] = torch.nn.functional.pad(own[key], (0, theirs.size(1) - length))
        with torch.no_grad():
            expected = model(**whole).logits[0]
        torch.testing.assert_close(logits[i, :theirs.size(1)], expected, rtol=1e-4, atol=1e-4)
    assert set(completions) >= {"input_ids", "labels", "attention_mask", "pixel_values"}
    assert "position_ids" not in completions  # Qwen-VL's are 3-D: the model makes them


def test_a_saved_rollout_leaves_the_pixels_out_and_makes_them_again_from_the_rows(prompts, tmp_path):
    rows, root = prompts
    processor = AutoProcessor.from_pretrained(save_vlm_model(tmp_path / "gemma3", "gemma3"))
    task = rollout_task(processor, rows, root)
    batch = task._collate("prompt", processor.tokenizer)(rows)
    completions = task._completion_batch(batch, Sampled(torch.full((2 * GROUPS, 3), processor.tokenizer.eos_token_id)))
    completions.pop("_rewards")
    saved = task.saved_batch(completions)
    assert not {"pixel_values", "token_type_ids"} & set(saved) and "input_ids" in saved
    restored = task.restored_batch(dict(saved))
    assert restored.keys() == completions.keys()
    for key, value in completions.items():
        assert torch.equal(restored[key], value), key


def test_reward_functions_get_the_images_decoded(prompts, tmp_path):
    rows, root = prompts
    processor = AutoProcessor.from_pretrained(save_vlm_model(tmp_path / "llava", "llava"))
    columns = rollout_task(processor, rows, root).reward_columns(rows)
    assert [len(shown) for shown in columns["images"]] == [1, 1]
    assert all(isinstance(shown[0], Image.Image) and shown[0].mode == "RGB" for shown in columns["images"])
    assert columns["answer"] == [row["answer"] for row in rows] and "prompt" not in columns


def test_a_prompt_too_long_with_its_images_or_ending_with_an_answer_is_refused(prompts, tmp_path):
    rows, root = prompts
    processor = AutoProcessor.from_pretrained(save_vlm_model(tmp_path / "llava", "llava"))
    with pytest.raises(UsageError, match="its prompt is .* tokens with its images, more than the 5 that --block_size"):
        VisionPromptCollator(processor, 5, root)(rows)
    answered = {**rows[0], "prompt": [*rows[0]["prompt"], {"role": "assistant", "content": "red"}]}
    with pytest.raises(UsageError, match="the prompt ends with an assistant turn"):
        VisionPromptCollator(processor, 100, root)([answered])
