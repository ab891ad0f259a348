"""Mixtures of experts: what the model tree says (models/moe.py), LoRA on fused
experts (peft/lora.py) and the routers' loss and load (tasks/router.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from finetune.errors import UsageError
from finetune.models import moe
from finetune.peft.lora import add_adapters, lora_config, merged_weights, resolve_targets

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
FAMILIES = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8),
}


def tiny(family: str, seed: int = 0, **extra):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **SHAPE, **FAMILIES[family], **extra)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tree_names_experts_routers_and_active_parameters(family):
    model = tiny(family)
    assert moe.expert_count(model.config) == 4 and moe.experts_per_token(model.config) == 2
    fused = moe.fused_expert_parameters(model)
    assert sorted(n.rsplit(".", 1)[-1] for n in fused) == ["down_proj", "down_proj", "gate_up_proj", "gate_up_proj"]
    routers = moe.routers(model)
    assert len(routers) == 2 and all(r.weight.shape == (4, 32) for r in routers.values())
    counts = moe.parameter_counts(model, model.config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counts["experts"] == experts and counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["active"] == counts["total"] - experts // 2  # 2 of 4 experts per token


def test_a_dense_model_has_no_experts():
    config = AutoConfig.for_model("llama", **SHAPE)
    model = AutoModelForCausalLM.from_config(config)
    assert not moe.is_moe(config) and moe.fused_expert_parameters(model) == [] and moe.routers(model) == {}


def trained(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_all_linear_reaches_the_experts_not_the_routers_and_merges_as_peft_does(family):
    """Adapter keys on every layer's fused experts, none on a router; the
    logits move; our merge equals peft's merge_and_unload tensor by tensor."""
    from finetune.model_dir import Weights

    base = tiny(family)
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        before = base(tokens).logits
    model = trained(add_adapters(base, lora_config(4, 8.0, 0.05, "all-linear")))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".experts." in n for n in names)
    assert not any(f".{r.rsplit('.', 1)[-1]}.lora_" in n for n in names for r in moe.routers(base))
    # peft adapts the experts in place, without dropout; the linear layers keep theirs
    dropouts = {n: m for n, m in model.named_modules() if n.endswith("lora_dropout.default")}
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.05 for n, m in dropouts.items() if "q_proj" in n)
    assert all(isinstance(m, torch.nn.Identity) for n, m in dropouts.items() if ".experts." in n)
    model.eval()
    with torch.no_grad():
        adapted = model(tokens).logits
    assert (adapted - before).abs().max() > 1e-3
    live = model.state_dict()
    weights = merged_weights({n: (t.shape, t.dtype) for n, t in live.items()}, Weights.in_memory(live).fetch,
                             dict(model.named_modules()))
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(weights.specs) == set(expected)
    got = weights.fetch(list(weights.specs))
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6)


def test_named_experts_and_routers_are_adapted_and_a_name_matching_nothing_is_refused():
    model = tiny("qwen3_moe")
    targets = resolve_targets(model, lora_config(4, 8.0, 0.0, "q_proj,experts,gate"))
    assert targets.modules == ["q_proj"]
    assert targets.parameters == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"]
    only_one = resolve_targets(model, lora_config(4, 8.0, 0.0, "experts.down_proj"))
    assert only_one.modules == [] and only_one.parameters == ["mlp.experts.down_proj"]
    with pytest.raises(UsageError, match="matches no module or parameter.*experts"):
        resolve_targets(model, lora_config(4, 8.0, 0.0, "w1"))


def test_qlora_refuses_fused_experts_in_one_line():
    pytest.importorskip("torchao")
    from finetune.config import TrainConfig
    from finetune.peft.qlora import QLoRA

    qlora = QLoRA(TrainConfig(peft="qlora"))
    with pytest.raises(UsageError, match="fused experts.*--peft lora.*--lora_target_modules"):
        qlora.adapt_base(tiny("mixtral"))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_our_aux_loss_is_the_one_transformers_forward_returns(family):
    """For a fixed batch: cross-entropy + coefficient x aux from our router
    hooks equals transformers' own loss with output_router_logits, to 1e-5."""
    from finetune.config import TrainConfig
    from finetune.tasks.router import Routers

    model = tiny(family, router_aux_loss_coef=0.02).eval()
    tokens = torch.randint(0, 64, (2, 12))
    theirs = model(input_ids=tokens, labels=tokens, output_router_logits=True)
    routers = Routers.of(model, TrainConfig(model="m", output_router_logits=True))
    assert routers.coefficient == 0.02
    with routers.watching(None) as routing:
        logits = model(input_ids=tokens).logits
    cross_entropy = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    added, metrics = routers.terms(routing, None, targets=1)
    torch.testing.assert_close(added, 0.02 * theirs.aux_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(cross_entropy + added, theirs.loss, rtol=0, atol=1e-5)
    assert metrics["expert_tokens"].shape == (2, 4) and metrics["expert_tokens"].sum() == 2 * 24 * 2


def test_router_options_are_refused_on_a_dense_model():
    from finetune.config import TrainConfig
    from finetune.tasks.router import Routers

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SHAPE))
    assert Routers.of(model, TrainConfig(model="m")) is None
    with pytest.raises(UsageError, match="applies to mixture-of-experts models.*dense"):
        Routers.of(model, TrainConfig(model="m", output_router_logits=True))


def test_expert_load_per_layer():
    from finetune.tasks.router import load_metrics

    metrics = load_metrics(torch.tensor([[10.0, 10.0, 10.0, 10.0], [40.0, 0.0, 0.0, 0.0]]))
    assert metrics["expert_load/layer_0/entropy"] == pytest.approx(1.0)
    assert metrics["expert_load/layer_1/max"] == 1.0 and metrics["expert_load/layer_1/min"] == 0.0
    assert metrics["expert_load_entropy"] == pytest.approx(0.0) and metrics["expert_load_max"] == 1.0


@pytest.mark.parametrize("overrides, message", [
    (dict(peft="lora", lora_target_modules="q_proj,experts", lora_dropout=0.1), "without dropout; pass --lora_dropout 0"),
    (dict(peft="lora", lora_target_modules="mlp.gate", lora_dropout="0.05"), "names mlp.gate"),
    (dict(router_aux_loss_coef=0.01), "add --output_router_logits"),
    (dict(method="dpo", output_router_logits=True), "is read by --method sft"),
    (dict(output_router_logits=True, router_aux_loss_coef="nan"), "must be a number"),
])
def test_router_and_dropout_options_are_refused_in_one_line(overrides, message):
    from finetune.config import load_config

    with pytest.raises(UsageError, match=message):
        load_config(None, {"model": "m", **overrides})


def test_dropout_by_default_on_named_experts_is_left_to_the_linear_layers():
    from finetune.config import load_config

    cfg = load_config(None, {"model": "m", "peft": "lora", "lora_target_modules": "q_proj,experts"})
    assert cfg.lora_dropout == 0.05  # not asked for: the experts get none, and the start line says so
