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
