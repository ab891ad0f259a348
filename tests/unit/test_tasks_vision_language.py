"""The vision task's resizing options and frozen parts, on the tiny families' processors and models."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers as T

from finetune.errors import UsageError
from finetune.peft.lora import add_adapters, lora_config
from finetune.tasks.vision_language import freeze_parts, resize_images
from vlm_models import vlm_parts


def options(**given):
    return SimpleNamespace(**{"model": "m", "max_pixels": 0, "min_pixels": 0, "image_size": 0,
                              "freeze_vision_tower": True, "freeze_projector": False, **given})


def qwen_like():
    """Qwen-VL's image processor, which resizes by pixel count (its processor needs torchvision; this part does not)."""
    return SimpleNamespace(image_processor=T.Qwen2VLImageProcessor(min_pixels=784, max_pixels=3136))


def test_pixel_counts_go_to_processors_that_resize_by_them_down_to_one_image_token():
    processor = qwen_like()
    resize_images(processor, options(max_pixels=28 * 28 * 16, min_pixels=28 * 28 * 4))
    size = processor.image_processor.size
    assert (size.longest_edge, size.shortest_edge) == (28 * 28 * 16, 28 * 28 * 4)
    with pytest.raises(UsageError, match="--max_pixels 700 is below the family's minimum of 784 pixels"):
        resize_images(qwen_like(), options(max_pixels=700))
    with pytest.raises(UsageError, match=r"--image_size sets the longest side .*; pass --max_pixels"):
        resize_images(qwen_like(), options(image_size=64))


def test_the_longest_side_goes_to_processors_that_resize_by_it_and_others_refuse_both():
    _, idefics = vlm_parts("idefics3")
    resize_images(idefics, options(image_size=42))
    assert idefics.image_processor.size.longest_edge == 42
    with pytest.raises(UsageError, match=r"resizes images by their pixel count, which .* does not; pass --image_size"):
        resize_images(idefics, options(max_pixels=4096))
    _, llava = vlm_parts("llava")
    with pytest.raises(UsageError, match="its vision tower takes one size; drop it"):
        resize_images(llava, options(image_size=56))


@pytest.mark.parametrize("freeze_tower", [True, False])
def test_lora_adapts_the_language_model_and_the_tower_only_when_it_trains(freeze_tower):
    config, _ = vlm_parts("llava")
    model = T.AutoModelForImageTextToText.from_config(config)
    frozen = freeze_parts(model, options(freeze_vision_tower=freeze_tower))
    assert frozen == (["model.vision_tower"] if freeze_tower else [])
    adapted = add_adapters(model, lora_config(4, 8, 0.0, "all-linear", "image-text-to-text"))
    lora = [name for name, _ in adapted.named_parameters() if "lora_A" in name]
    assert any(".language_model." in name for name in lora)
    assert any(".multi_modal_projector." in name for name in lora)
    assert any(".vision_tower." in name for name in lora) is not freeze_tower


def test_freezing_parts_a_model_lacks_is_refused():
    from finetune.config import TrainConfig  # noqa: F401  (the options exist under these names)

    config, _ = vlm_parts("gemma3")
    model = T.AutoModelForImageTextToText.from_config(config)
    assert freeze_parts(model, options(freeze_projector=True)) == ["model.vision_tower", "model.multi_modal_projector"]
    assert not any(p.requires_grad for p in model.model.multi_modal_projector.parameters())
    with pytest.raises(UsageError, match="has no module named vision_tower"):
        freeze_parts(T.LlamaForCausalLM(T.LlamaConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                                      num_attention_heads=2, vocab_size=16)), options())


@pytest.mark.parametrize("method", ["sft", "dpo", "orpo", "simpo", "grpo", "rloo"])
def test_each_method_that_takes_images_trains_on_them_with_its_own_loss(method):
    """Pairs (DPO, ORPO, SimPO) and rollouts (GRPO, RLOO) each have their
    vision task: the family's processor makes the batches, the objective's
    task its loss; text's task for the same method on causal-lm."""
    from finetune.config import TrainConfig
    from finetune.objectives import REGISTRY, build_task
    from finetune.objectives.pairs import PreferenceLM
    from finetune.objectives.rollouts import RolloutLM
    from finetune.tasks.vision_language import VisionLanguageLM

    options = {"reward_funcs": ["exact_match"]} if method in ("grpo", "rloo") else {}
    vision = build_task(TrainConfig(task="image-text-to-text", objective=method, **options))
    text = build_task(TrainConfig(task="causal-lm", objective=method, **options))
    assert isinstance(vision, VisionLanguageLM) and not isinstance(text, VisionLanguageLM)
    assert "image-text-to-text" in REGISTRY[method].tasks
    for family in (PreferenceLM, RolloutLM):
        assert isinstance(vision, family) == isinstance(text, family)
