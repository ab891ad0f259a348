"""Image chat rows for vision-language models: the checks when data loads, and
the batches the collator makes, against transformers' own assistant mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from finetune.config import TrainConfig
from finetune.data.shapes import build_shapes
from finetune.data.vision import VisionChatEncoder, VisionCollator, answer_mask, check_rows, conversation
from finetune.errors import UsageError
from finetune.tasks.vision_language import VisionLanguageLM
from vlm_models import WITH_QWEN, IMAGE_TOKENS, PLACEHOLDERS, save_vlm_model, vlm_parts


def tagged(placeholder: str) -> str:
    """The test models' ChatML with each answer and its end-of-turn token in
    {% generation %} tags, for transformers' assistant mask."""
    part = ("{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '" + placeholder + "' }}"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}")
    return ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
            "{% if message['role'] == 'assistant' %}{% generation %}" + part + "{{ '<|im_end|>' }}{% endgeneration %}"
            "{{ '\n' }}{% else %}" + part + "{{ '<|im_end|>\n' }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return build_shapes(cache=tmp_path_factory.mktemp("cache"))


def rows_of(data: Path, count: int, start: int = 0) -> list[dict]:
    return [json.loads(line) for line in data.read_text().splitlines()[start:start + count]]


@pytest.mark.parametrize("family", WITH_QWEN)
def test_answer_loss_equals_transformers_own_assistant_mask(family, shapes, tmp_path):
    """The loss of a fixed batch (rows of different lengths, padded) equals the
    one transformers computes with the processor alone: its assistant mask from
    a tagged template, its own shifted cross-entropy."""
    model_dir = save_vlm_model(tmp_path / family, family)
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    rows = rows_of(shapes, 4)
    rows[1]["messages"][0]["content"].insert(0, {"type": "text", "text": "Look at the picture."})  # ragged lengths
    batch = VisionCollator(VisionChatEncoder(processor, train_on_prompt=False), 512, shapes.parent)(rows)
    task = VisionLanguageLM(TrainConfig(task="image-text-to-text"))
    with torch.no_grad():
        ours = task._forward(model, batch)
    ours_mean = ours.total / ours.has_target.sum()

    images = [[Image.open(shapes.parent / name).convert("RGB") for name in row["images"]] for row in rows]
    theirs = processor.apply_chat_template(
        [row["messages"] for row in rows], chat_template=tagged(PLACEHOLDERS[family]), tokenize=True,
        return_dict=True, return_tensors="pt", return_assistant_tokens_mask=True,
        processor_kwargs=dict(images=images, padding=True, padding_side="right", add_special_tokens=False))
    mask = theirs.pop("assistant_masks")
    labels = theirs["input_ids"].masked_fill(mask == 0, -100)
    with torch.no_grad():
        expected = model(**theirs, labels=labels).loss
    assert torch.equal(batch["input_ids"], theirs["input_ids"])
    assert int((labels != -100).sum()) == int((batch["labels"] != -100).sum()) > 0
    torch.testing.assert_close(ours_mean, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", WITH_QWEN)
def test_image_tokens_carry_no_loss_even_with_train_on_prompt(family, shapes):
    _, processor = vlm_parts(family)
    rows = rows_of(shapes, 3)
    batch = VisionCollator(VisionChatEncoder(processor, train_on_prompt=True), 512, shapes.parent)(rows)
    image_ids = torch.tensor(processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKENS[family]))
    image = torch.isin(batch["input_ids"], image_ids)
    assert image.any()
    assert (batch["labels"][image] == -100).all()
    for i, row in enumerate(rows):  # the prompt's text is learnt, as asked, beside the answer
        learnt = processor.tokenizer.decode(batch["labels"][i][batch["labels"][i] != -100])
        assert row["messages"][0]["content"][1]["text"] in learnt
        assert learnt.endswith(row["messages"][1]["content"][0]["text"] + "<|im_end|>\n")


def test_a_long_row_loses_its_answers_tail_and_one_whose_image_does_not_fit_is_refused(shapes):
    _, processor = vlm_parts("llava")
    encoder = VisionChatEncoder(processor, train_on_prompt=False)
    row = rows_of(shapes, 1)[0]
    full = VisionCollator(encoder, 512, shapes.parent)([row])
    length = int(full["attention_mask"].sum())
    cut = VisionCollator(encoder, length - 2, shapes.parent)([row])
    assert cut["input_ids"].shape[1] == length - 2
    assert torch.equal(cut["labels"], full["labels"][:, : length - 2])
    with pytest.raises(UsageError, match="its images end past --block_size 4"):
        VisionCollator(encoder, 4, shapes.parent)([row])


def test_answer_spans_shift_past_the_expanded_images():
    # "<i>ab" with <i> expanded to 10 characters: the answer "ab" (chars 3-5) sits at 10-12 after it.
    replacements = [{"span": (0, 3), "new_span": (0, 10)}]
    offsets = [(0, 5), (5, 10), (10, 11), (11, 12), (0, 0)]
    assert answer_mask(offsets, [(3, 5)], replacements) == [False, False, True, True, False]


def _row(tmp_path: Path, images, content=None) -> dict:
    content = content or [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "images": images}


@pytest.mark.parametrize("images, content, expected", [
    (["missing.png"], None, "does not exist"),
    (["notes.txt"], None, "is not an image PIL can read"),
    (["../outside.png"], None, "leads outside the data's dir"),
    (["/etc/passwd"], None, "is not relative to the data file's dir"),
    ([], None, "hold 1 image part(s) but the row gives 0 image(s)"),
    (["red.png", "red.png"], None, "hold 1 image part(s) but the row gives 2 image(s)"),
    (["red.png"], [{"type": "video"}], "a content part is"),
])
def test_bad_rows_are_named_with_the_fix(images, content, expected, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(data / "red.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "outside.png")
    (data / "notes.txt").write_text("not an image")
    with pytest.raises(UsageError, match="example 1: .*" + expected.replace("(", r"\(").replace(")", r"\)")):
        check_rows([_row(tmp_path, images, content)], data, "--dataset d")


def test_images_without_parts_go_first_in_the_first_user_turn_and_bytes_are_images(tmp_path):
    import io

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 0, 255)).save(buffer, format="PNG")
    row = {"prompt": "What colour?", "completion": "blue", "image": {"bytes": buffer.getvalue(), "path": None}}
    talk = conversation(row, "example 1")
    assert talk.messages[0]["content"][0] == {"type": "image"} and talk.messages[1]["role"] == "assistant"
    assert check_rows([row], None, "--dataset d") == 1
