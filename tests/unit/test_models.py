"""Unit tests of loading models by id or dir (finetune/models)."""

from __future__ import annotations

import pytest

from finetune.errors import UsageError


def test_a_reference_model_that_is_no_model_is_named_as_the_reference(tmp_path):
    from finetune.models import load_config

    (tmp_path / "notes").mkdir()
    with pytest.raises(UsageError, match=r"^--reference_model .*notes is not a model directory \(no config.json\); "
                                         "pass a dir written by save_pretrained or a Hub id$"):
        load_config(str(tmp_path / "notes"), False, "", option="--reference_model")


def test_a_config_whose_sizes_no_model_has_is_one_line_before_anything_is_built(tmp_path):
    """Hundreds of thousands of layers (the planner would build them on the meta
    device for minutes), a negative vocabulary or context length (a traceback
    deep in a library): refused by the planner, GGUF export and loading alike."""
    from transformers import GPT2Config, LlamaConfig

    from finetune.memory import model_shape
    from finetune.models import check_config_sizes

    check_config_sizes(LlamaConfig(num_hidden_layers=80, hidden_size=8192, vocab_size=128256), "llama")
    check_config_sizes(GPT2Config(), "gpt2")
    for key, value in (("n_layer", 300_000), ("vocab_size", -5), ("n_positions", -1), ("n_head", 0)):
        with pytest.raises(UsageError, match=f"has {key} {value!r}, which no model has"):
            check_config_sizes(GPT2Config(**{key: value}), "DIR")
        GPT2Config(**{key: value}).save_pretrained(tmp_path / key)
        with pytest.raises(UsageError, match=f"the config of --model .*{key} has {key}"):
            model_shape(str(tmp_path / key))
