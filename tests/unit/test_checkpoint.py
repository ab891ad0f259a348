"""Unit tests of what a checkpoint stores."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("family, tied", [("llama", True), ("llama", False), ("qwen2", True)])
def test_a_tied_parameter_is_saved_under_one_name_and_loads_back_tied(family, tied):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from finetune.checkpoint import StoredState

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    config = config_class(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = model_class(config)
    trained = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    StoredState(model).active = True
    saved = model.state_dict()
    assert ("lm_head.weight" in saved) is not tied and "model.embed_tokens.weight" in saved
    assert set(trained) - set(saved) == ({"lm_head.weight"} if tied else set())

    torch.manual_seed(1)
    fresh = model_class(config)
    StoredState(fresh).active = True
    fresh.load_state_dict(saved)  # strict: the missing name is the tied one, restored from its first name
    assert (fresh.lm_head.weight is fresh.model.embed_tokens.weight) is tied
    for name, tensor in fresh.named_parameters(remove_duplicate=False):
        assert torch.equal(tensor, trained[name]), name


def test_fsdp1_checkpoints_keep_every_parameter_name():
    """FSDP1's state-dict hooks run after the wrapped model's and check that every
    parameter is still there, so its checkpoints leave nothing out; the others do."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.backends import REGISTRY
    from finetune.checkpoint import StoredState

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    for backend in REGISTRY:
        model = LlamaForCausalLM(config)
        model.model.norm.weight.requires_grad_(False)  # a frozen parameter, as a base under adapters
        StoredState(model, leave_out=backend.checkpoints_leave_out_stored_state).active = True
        left_out = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(model.state_dict())
        expected = set() if backend.__name__ == "FSDP1" else {"lm_head.weight", "model.norm.weight"}
        assert left_out == expected, backend.__name__


def test_a_lora_checkpoint_holds_the_adapters_only_and_loads_them_into_the_live_base():
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.checkpoint import StoredState
    from finetune.peft import lora

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    base_state = {name: t.clone() for name, t in base.state_dict().items()}
    model = lora.add_adapters(base, lora.lora_config(4, 8.0, 0.0, "all-linear"))
    with torch.no_grad():  # trained adapters: B is no longer zero
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.normal_()
    trained = {name: t.clone() for name, t in model.state_dict().items()}
    stored = StoredState(model)
    assert len(model.state_dict()) == len(trained)  # inactive: the whole state, as the end-of-run gather needs
    stored.active = True
    saved = model.state_dict()
    assert saved and all(".lora_" in name for name in saved)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(saved)

    torch.manual_seed(1)
    fresh_base = LlamaForCausalLM(config)
    fresh_base.load_state_dict(base_state)  # the base, read from --model
    fresh = lora.add_adapters(fresh_base, lora.lora_config(4, 8.0, 0.0, "all-linear"))
    StoredState(fresh).active = True
    fresh.load_state_dict(saved)  # strict: every frozen name comes from the live model
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
