"""Tiny random-weight vision-language models of four families, saved as HF
model dirs with their processors (a ChatML template that renders image parts,
the family's image tokens and image processor), for the vision tests: LLaVA,
Idefics3 (SmolVLM's architecture), Gemma 3 and Qwen2.5-VL. Qwen-VL's
processors need torchvision (for video frames), which has no build for this
project's CPU torch: its tests run where torchvision is installed
(`WITH_QWEN`), and are skipped elsewhere."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers as T

from finetune.data.shapes import COLOURS, QUESTIONS, SHAPES
from sft_models import chat_tokenizer, conversations

FAMILIES = ("llava", "idefics3", "gemma3")
# Qwen2.5-VL where torchvision is installed (skipped, and saying why, where it is not).
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
needs_torchvision = pytest.mark.skipif(not HAS_TORCHVISION, reason="Qwen-VL's processor needs torchvision")
WITH_QWEN = (*FAMILIES, pytest.param("qwen2_5_vl", marks=needs_torchvision))
# What each family's template writes for an image part (its processor expands it).
PLACEHOLDERS = {"llava": "<image>", "idefics3": "<image>", "gemma3": "<start_of_image>",
                "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
IMAGE_TOKENS = {"llava": ["<image>"], "idefics3": ["<image>", "<fake_token_around_image>", "<global-img>"],
                "gemma3": ["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
                "qwen2_5_vl": ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]}
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def template(placeholder: str) -> str:
    """ChatML whose content is a string or parts, image parts written as `placeholder`."""
    return ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '" + placeholder + "' }}"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def vlm_tokenizer(family: str):
    """The chat tokenizer, trained also on the shapes' questions and answers, with the family's image tokens."""
    texts = [m["content"] for row in conversations(200) for m in row["messages"]]
    texts += [*QUESTIONS.values(), *COLOURS, *SHAPES] * 20
    tok = chat_tokenizer(texts)
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS[family]})
    named = {}  # the image tokens a family's processor reads by name from the tokenizer
    if family == "gemma3":
        named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    elif family == "qwen2_5_vl":
        named = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                 "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"}
    if named:
        tok = T.PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, bos_token=tok.bos_token,
                                        eos_token=tok.eos_token, pad_token=tok.pad_token, unk_token=tok.unk_token,
                                        extra_special_tokens=named)
    tok.chat_template = template(PLACEHOLDERS[family])
    return tok


def vlm_parts(family: str, width: int = 32, layers: int = 2):
    """(config, processor) of a tiny `family` model: 28-56 pixel images of 4
    to 16 tokens, `layers` blocks of `width` in the tower and the language model."""
    TEXT = dict(globals()["TEXT"], hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers)
    VISION = dict(globals()["VISION"], hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers)
    tok = vlm_tokenizer(family)
    chat = template(PLACEHOLDERS[family])
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    token = tok.convert_tokens_to_ids
    if family == "llava":
        images = T.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        processor = T.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14, chat_template=chat,
                                     vision_feature_select_strategy="default", num_additional_image_tokens=1)
        config = T.LlavaConfig(vision_config=T.CLIPVisionConfig(**VISION, image_size=28, patch_size=14),
                               text_config=T.LlamaConfig(**TEXT, **ids), image_token_index=token("<image>"),
                               vision_feature_layer=-1)
    elif family == "idefics3":
        images = T.Idefics3ImageProcessor(size={"longest_edge": 56}, max_image_size={"longest_edge": 56},
                                          do_image_splitting=False)
        processor = T.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=chat)
        config = T.Idefics3Config(vision_config=dict(**VISION, image_size=56, patch_size=14),
                                  text_config=dict(model_type="llama", **TEXT, **ids), image_token_id=token("<image>"),
                                  scale_factor=2, **ids)
    elif family == "gemma3":
        images = T.Gemma3ImageProcessor(size={"height": 28, "width": 28})
        processor = T.Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=chat, image_seq_length=4)
        config = T.Gemma3Config(text_config=dict(**TEXT, **ids, head_dim=8, sliding_window=64),
                                vision_config=dict(**VISION, image_size=28, patch_size=7), mm_tokens_per_image=4,
                                image_token_index=token("<image_soft_token>"), boi_token_index=token("<start_of_image>"),
                                eoi_token_index=token("<end_of_image>"), **ids)
    elif family == "qwen2_5_vl":  # 56-pixel images: 2x2 tokens of 2x2 merged 14-pixel patches
        images = T.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56, patch_size=14, merge_size=2)
        processor = T.Qwen2_5_VLProcessor(image_processor=images, tokenizer=tok, chat_template=chat,
                                          video_processor=T.Qwen2VLVideoProcessor())
        rope = {"rope_type": "default", "mrope_section": [1, 1, 2]}  # the head's 4 rotary pairs: time, height, width
        config = T.Qwen2_5_VLConfig(
            text_config=dict(**TEXT, **ids, rope_parameters=rope),
            vision_config=dict(depth=layers, hidden_size=width, intermediate_size=2 * width, num_heads=4,
                               out_hidden_size=width, patch_size=14, spatial_merge_size=2, fullatt_block_indexes=[1],
                               window_size=56),
            image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
            vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"), **ids)
    else:
        raise ValueError(family)
    return config, processor


def save_vlm_model(path: Path, family: str, seed: int = 0, width: int = 32, layers: int = 2) -> Path:
    config, processor = vlm_parts(family, width, layers)
    torch.manual_seed(seed)
    T.AutoModelForImageTextToText.from_config(config).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def greedy_accuracy(model_dir: Path, rows: list[dict], root: Path) -> float:
    """The share of rows whose first answer a model dir writes exactly, greedily,
    read and run with transformers alone."""
    from PIL import Image

    model = T.AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = T.AutoProcessor.from_pretrained(model_dir)
    right = 0
    for row in rows:
        text = processor.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=False)
        images = [[Image.open(root / name).convert("RGB") for name in row["images"]]]
        inputs = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        answer = processor.tokenizer.decode(out[0, inputs["input_ids"].size(1):], skip_special_tokens=True)
        right += answer.strip() == row["messages"][1]["content"][0]["text"]
    return right / len(rows)


def shape_pairs(shapes: Path) -> Path:
    """Preference pairs (TRL's prompt/chosen/rejected with images) of the drawn
    shapes, beside their images: the right answer chosen, a word of the other
    question's kind rejected (a shape's name for a colour)."""
    import json
    import random

    rng = random.Random(0)
    pairs = []
    for line in shapes.read_text().splitlines():
        row = json.loads(line)
        answer = row["messages"][1]["content"][0]["text"]
        wrong = rng.choice(SHAPES if answer in COLOURS else list(COLOURS))
        pairs.append({"prompt": row["messages"][:1], "images": row["images"],
                      "chosen": [{"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                      "rejected": [{"role": "assistant", "content": [{"type": "text", "text": wrong}]}]})
    path = shapes.with_name("cross-pairs.jsonl")  # beside the images, and the built-in pairs.jsonl
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return path
