"""The task registry: every task this tool trains, by name, with the Auto
class of its models, its presets and the config defaults that differ for it.

Adding a task means one entry here and one `Task` subclass in its own module
(see base.py for what the loop asks of it). This module is light on purpose:
the config and the command line read it without importing torch; a task's
class, whose module imports the heavy libraries, is loaded only when a run,
an export or an evaluation needs it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from finetune.data.locations import IMAGE_FILES, TEXT_FILES
from finetune.errors import UsageError
from finetune.presets import CNN_MODEL_TYPE, CNN_PRESETS, GPT2_PRESETS


@dataclass(frozen=True)
class TaskEntry:
    name: str
    task_class: str                  # "module:Class" of its Task
    auto_class: str                  # the transformers Auto class its models load with...
    model_mapping: str               # ...and that class's public mapping of config classes to models
    presets: tuple[str, ...]         # named models built from scratch (finetune/presets.py)
    data_files: dict[str, str]       # the local files its data is read from: suffix -> datasets builder
    defaults: dict[str, Any] = field(default_factory=dict)  # TrainConfig values that differ for this task
    generative: bool = False         # its models generate text: exports carry a generation config
    has_tokenizer: bool = False      # its models come with a tokenizer, saved next to them
    has_processor: bool = False      # ...within a processor (a vision-language model's: tokenizer and image processor)

    def load_class(self) -> type:
        """Its finetune.tasks.base.Task subclass."""
        module, name = self.task_class.split(":")
        return getattr(importlib.import_module(module), name)

    def auto(self):
        return getattr(_transformers(), self.auto_class)

    def builds(self, config) -> bool:
        """Whether this task's Auto class has a model for this HF config."""
        return bool(self.model_class_names(config))

    def model_class_names(self, config) -> tuple[str, ...]:
        """The names of the classes this task's Auto class builds for this HF
        config (none when it builds none), read from transformers' tables of
        names: no model code is imported (1.1 s here), so that reading a model
        dir stays quick."""
        if config.model_type == CNN_MODEL_TYPE:  # ours: registered with the Auto classes by finetune.models.cnn
            return ("LectureCNN",) if self.name == "image-classification" else ()
        from transformers.models.auto import configuration_auto, modeling_auto

        if config.model_type not in configuration_auto.CONFIG_MAPPING_NAMES:  # registered at run time (remote code)
            mapping = getattr(_transformers(), self.model_mapping)
            return (mapping[type(config)].__name__,) if type(config) in mapping else ()
        name = getattr(modeling_auto, self.model_mapping + "_NAMES").get(config.model_type, ())
        return (name,) if isinstance(name, str) else tuple(name)


def _transformers():
    import transformers

    import finetune.models.cnn  # noqa: F401  (registers the lecture CNN with the Auto classes)

    return transformers


REGISTRY: dict[str, TaskEntry] = {entry.name: entry for entry in (
    TaskEntry("causal-lm", "finetune.tasks.causal_lm:CausalLM", "AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING",
              tuple(GPT2_PRESETS), TEXT_FILES, generative=True, has_tokenizer=True),
    # A reward model (--method reward): the language model's body under a one-score head.
    TaskEntry("sequence-classification", "finetune.objectives.scored_pairs:RewardModel",
              "AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING", (), TEXT_FILES,
              has_tokenizer=True),
    # A vision-language model: conversations with images, through the model's own processor. Its images
    # expand into hundreds of tokens each (Gemma 3: 256; Qwen2.5-VL: one per 28x28 pixels), hence the longer rows.
    TaskEntry("image-text-to-text", "finetune.tasks.vision_language:VisionLanguageLM", "AutoModelForImageTextToText",
              "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING", (), TEXT_FILES, defaults=dict(block_size=1024, sample_prompt="", packing=False),
              generative=True, has_tokenizer=True, has_processor=True),
    # The lectures' recipe: Adam 1e-2 with L2 decay 1e-4, StepLR halving every
    # epoch, clipping at 0.1, accumulation 4, mini-batch 64, a checkpoint every 5 epochs.
    TaskEntry("image-classification", "finetune.tasks.image_classification:ImageClassification",
              "AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING", tuple(CNN_PRESETS),
              IMAGE_FILES, defaults=dict(
                  model="lecture-cnn", optimizer="adam", learning_rate=1e-2, adam_beta1=0.9, adam_beta2=0.999,
                  weight_decay=1e-4, lr_scheduler_type="step", lr_gamma=0.5, max_grad_norm=0.1,
                  gradient_accumulation_steps=4, per_device_batch_size=64, num_epochs=10, checkpoint_every_epochs=5,
                  eval_every_epochs=1, sample_prompt="")),
)}


def task_of_preset(model: str) -> TaskEntry | None:
    return next((entry for entry in REGISTRY.values() if model in entry.presets), None)


def task_for_config(config) -> TaskEntry | None:
    """The task a model of this HF config was saved for. One config class can
    serve several tasks (GPT2Config: a causal LM, a sequence classifier, ...),
    so the architecture `save_pretrained` recorded decides; without one, the
    first task whose Auto class builds the config."""
    able = [(entry, names) for entry in REGISTRY.values() if (names := entry.model_class_names(config))]
    # Gemma 3's vision-language class is also a causal LM's: a config with a vision tower is first the vision task's.
    sees = hasattr(config, "vision_config")
    able.sort(key=lambda found: found[0].has_processor != sees)
    saved_as = set(getattr(config, "architectures", None) or ())
    return next((entry for entry, names in able if saved_as.intersection(names)), None) or \
        next((entry for entry, _ in able), None)


def check_preset_task(model: str, task: str) -> None:
    """A preset serves one task; say which before anything is loaded."""
    entry = task_of_preset(model)
    if entry is not None and entry.name != task:
        fitting = ", ".join(REGISTRY[task].presets)
        raise UsageError(f"--model {model} is for --task {entry.name}, not {task}; "
                         f"pass --task {entry.name}, or a model for --task {task} ({fitting})")
