"""Unit tests of writing HF model dirs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from finetune.errors import UsageError
from finetune.model_dir import write_model_dir


def _tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=300,
                                      bos_token_id=0, eos_token_id=0))


def test_model_dir_stores_tied_weights_once_and_loads_tied(tmp_path):
    model = _tiny_model()
    write_model_dir(model.state_dict(), model.config, tmp_path / "out")
    stored = load_file(tmp_path / "out" / "model.safetensors")
    assert "lm_head.weight" not in stored and "transformer.wte.weight" in stored
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    ids = torch.arange(10).view(1, 10)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


def test_large_model_dir_is_split_with_an_index(tmp_path):
    model = _tiny_model()
    write_model_dir(model.state_dict(), model.config, tmp_path / "out", max_shard_size=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_model_dir_refuses_a_non_empty_target_and_leaves_it_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    model = _tiny_model()
    with pytest.raises(UsageError, match="exists and is not empty; pass --overwrite"):
        write_model_dir(model.state_dict(), model.config, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_bf16_model_dir_is_half_the_size(tmp_path):
    model = _tiny_model()
    write_model_dir(model.state_dict(), model.config, tmp_path / "fp32")
    fp32 = (tmp_path / "fp32" / "model.safetensors").stat().st_size
    for dtype in ("bfloat16", "float16"):
        write_model_dir(model.state_dict(), model.config, tmp_path / dtype, dtype=dtype)
        assert 0.45 < (tmp_path / dtype / "model.safetensors").stat().st_size / fp32 < 0.55
        assert AutoModelForCausalLM.from_pretrained(tmp_path / dtype).dtype == getattr(torch, dtype)
