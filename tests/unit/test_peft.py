"""Unit tests of LoRA and QLoRA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from finetune.config import TrainConfig


def test_merged_weights_equal_peft_merge_and_unload():
    """The final save's merge, tensor by tensor, gives exactly what peft's
    merge_and_unload gives: GPT-2's Conv1D (fan_in_fan_out) and Llama's Linear,
    with adapters that have trained (B nonzero)."""
    import copy

    from transformers import LlamaConfig

    from finetune.model_dir import Weights
    from finetune.peft.lora import add_adapters, lora_config, merged_weights

    torch.manual_seed(0)
    for base in (GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)),
                 AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                              num_attention_heads=2, vocab_size=64))):
        model = add_adapters(base, lora_config(4, 8, 0.0, "all-linear"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_()
        live = model.state_dict()
        before = {n: t.clone() for n, t in live.items()}
        weights = merged_weights({n: (t.shape, t.dtype) for n, t in live.items()},
                                 Weights.in_memory(live).fetch, dict(model.named_modules()))
        expected = copy.deepcopy(model).merge_and_unload().state_dict()
        assert set(weights.specs) == set(expected)
        got = weights.fetch(list(weights.specs))
        assert all(torch.equal(got[n], expected[n]) for n in expected)
        assert all(torch.equal(model.state_dict()[n], before[n]) for n in before)  # the live model is untouched


def test_qlora_quantises_the_adapted_weights_whose_shards_are_whole_nf4_blocks():
    """GPT-2's Conv1D layers become Linear (the same function); of the adapted
    weights, those whose shards split into whole blocks of 64 x 256 weights over
    the ranks turn 4-bit, the others stay, and the model still computes nearly
    what it did (NF4 rounds each weight to one of 16 levels per block)."""
    pytest.importorskip("torchao")
    from finetune.parameters import held_bytes
    from finetune.peft import lora, qlora

    torch.manual_seed(0)
    # c_attn 128 x 384 (49,152 weights: 3 blocks of 16,384, not splittable over 2 ranks), c_proj 128 x 128
    # (1 block), c_fc / mlp.c_proj 128 x 512 (4 blocks: 2 per rank).
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=128, n_layer=1, n_head=2, n_positions=32)).eval()
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        before = model(tokens).logits
    assert qlora.linears_for_conv1d(model) == 4
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, before, rtol=0, atol=1e-5)

    model = lora.add_adapters(model, lora.lora_config(4, 8.0, 0.0, "all-linear"))
    quantized, kept = qlora.quantize_adapted_bases(model, world_size=2, device=torch.device("cpu"))
    assert quantized == 2
    assert sorted(name.removeprefix("base_model.model.transformer.h.0.") for name in kept) == ["attn.c_attn", "attn.c_proj"]
    nf4 = qlora.nf4_tensor_class()
    weights = {name: p for name, p in model.named_parameters() if name.endswith("base_layer.weight")}
    four_bit = {name for name, p in weights.items() if isinstance(p, nf4)}
    assert four_bit == {n for n in weights if ".mlp." in n}
    for name in four_bit:
        assert not weights[name].requires_grad
        assert held_bytes(weights[name]) < 0.55 * weights[name].numel()  # about half a byte per weight
    with torch.no_grad():
        after = model(tokens).logits
    assert not torch.equal(after, before)
    assert (after - before).abs().max() < 0.1 * before.abs().max()


def test_each_method_runs_the_model_without_what_it_added():
    """`adapters_off`: the base's forward under LoRA (what a preference method's
    reference model will be), the adapters back afterwards; a full fine-tune
    added nothing to switch off."""
    pytest.importorskip("peft")
    from finetune.peft import peft_for

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16)).eval()
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        base_logits = base(tokens).logits.clone()
    lora = peft_for(TrainConfig(peft="lora", lora_r=4))
    model = lora.wrap(base, source="in-memory", accelerator=None, record_base=False).eval()  # no dropout
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p)  # peft starts B at zero: the adapters would change nothing yet
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        adapted = model(tokens).logits.clone()
        with lora.adapters_off(model):
            off = model(tokens).logits.clone()
            # Still trainable while off: FSDP2 under bf16 fixes a parameter's gradient dtype at its
            # first forward, and a first forward with them frozen had the first backward refuse them.
            assert {name for name, p in model.named_parameters() if p.requires_grad} == trainable
        again = model(tokens).logits
    assert not torch.allclose(adapted, base_logits, atol=1e-4)
    torch.testing.assert_close(off, base_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(again, adapted, rtol=0, atol=0)

    full = peft_for(TrainConfig())
    assert full.wrap(base, source="in-memory", accelerator=None, record_base=False) is base
    with full.adapters_off(base):
        pass
