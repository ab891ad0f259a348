"""The generation engines (finetune/objectives/engines.py) in one process: a
replica samples what the model itself does, full and under LoRA, and again
after the trained weights move; auto's pick and the replica that cannot fit."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune.backends.base import Backend
from finetune.errors import UsageError
from finetune.objectives import engine_choice
from finetune.objectives.engine_choice import choose_engine
from finetune.objectives.engines import AsHeld, Replica
from tests.sft_models import chat_tokenizer, conversations, tiny_llama


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer([m["content"] for row in conversations(20) for m in row["messages"]])


def one_process() -> SimpleNamespace:
    return SimpleNamespace(unwrap_model=lambda m: m, num_processes=1, device=torch.device("cpu"))


def sampled(generator, prompt: torch.Tensor, tokenizer) -> torch.Tensor:
    torch.manual_seed(7)
    return generator.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0,
                              max_new_tokens=6, pad_token_id=tokenizer.pad_token_id, eos_token_id=None)


@pytest.mark.parametrize("adapted", [False, True])
def test_a_replica_samples_as_the_model_does_and_follows_its_steps(tokenizer, adapted):
    model = tiny_llama(tokenizer)
    if adapted:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    prompt = torch.tensor([tokenizer("the model reads")["input_ids"]] * 3)
    replica = Replica(one_process(), Backend())
    for step in range(2):
        copy_of, synced, _ = replica.generator(model)
        assert copy_of is not model and not synced
        assert torch.equal(sampled(copy_of, prompt, tokenizer), sampled(model, prompt, tokenizer)), step
        with torch.no_grad():  # a training step: the trainable weights move
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.5)
        replica.weights_changed()
    trained = {n: p for n, p in model.named_parameters()}
    held = dict(replica.copy.named_parameters())
    assert replica.stale and not all(torch.equal(held[n], p) for n, p in trained.items() if p.requires_grad)
    replica.generator(model)  # refreshed in place, at the next sampling
    assert not replica.stale
    assert all(torch.equal(held[n], p) for n, p in trained.items() if p.requires_grad)
    assert all(p.data_ptr() != trained[n].data_ptr() for n, p in held.items())  # a copy, never the trained tensor


class Sharding(Backend):
    def shards_parameters(self, accelerator) -> bool:
        return True


def test_auto_takes_the_replica_where_it_fits_and_a_replica_that_cannot_fit_is_one_line(tokenizer, monkeypatch):
    model = tiny_llama(tokenizer)
    size = sum(p.numel() for p in model.parameters()) * 4
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, num_processes=2, device=torch.device("cpu"))
    monkeypatch.setattr(engine_choice, "free_memory", lambda device: 10 * size)
    assert choose_engine("auto", accelerator, Sharding(), model).name == "replica"
    whole = choose_engine("auto", accelerator, Backend(), model)
    assert whole.name == "sharded" and "each rank holds the whole model" in whole.why
    monkeypatch.setattr(engine_choice, "free_memory", lambda device: size + size // 2)
    assert choose_engine("auto", accelerator, Sharding(), model).name == "sharded"  # not in half of it
    assert choose_engine("replica", accelerator, Sharding(), model).name == "replica"  # asked, and it fits
    monkeypatch.setattr(engine_choice, "free_memory", lambda device: size // 2)
    with pytest.raises(UsageError, match=r"--generation_engine replica keeps a whole copy of the policy .* pass "
                                         r"--generation_engine sharded"):
        choose_engine("replica", accelerator, Sharding(), model)
    assert type(engine_choice.engine_classes()["sharded"](accelerator, Backend())) is AsHeld


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_weights_vllm_loads_are_peft_merged_checkpoint_under_lora(tokenizer, arch):
    """What the vllm engine loads into vLLM, named and valued as the merged
    model's own checkpoint (peft's merge_and_unload), adapters that moved;
    GPT-2's Conv1D layers hold their weights transposed (fan_in_fan_out)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from finetune.objectives.vllm_engine import merged_weights

    torch.manual_seed(0)
    if arch == "llama":
        model, targets = tiny_llama(tokenizer), ["q_proj", "v_proj", "down_proj"]
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64))
        targets = ["c_attn", "c_proj"]
    adapted = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                               fan_in_fan_out=arch == "gpt2"))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.3)  # trained adapters: B is no longer 0
    sent = dict(merged_weights(adapted, ((n, p.detach()) for n, p in adapted.named_parameters())))
    merged = copy.deepcopy(adapted).merge_and_unload()
    expected = dict(merged.named_parameters())
    assert sorted(sent) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.allclose(sent[name], tensor, atol=1e-6), name
    base = {n.removeprefix("base_model.model.").replace(".base_layer.", "."): p
            for n, p in adapted.named_parameters() if "lora_" not in n}
    changed = {n for n in expected if not torch.allclose(expected[n], base[n])}  # the adapters moved these alone
    assert changed == {n for n in expected if n.endswith(".weight") and n.split(".")[-2] in targets}


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """The stand-in importable as `vllm` for one test, and gone from sys.modules after it
    (else a later test in this process would find a vLLM installed)."""
    import sys

    def forget():
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]

    forget()
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "stand_ins"))
    yield forget
    forget()


def test_auto_takes_vllm_on_a_gpu_where_it_is_installed(tokenizer, monkeypatch, stand_in_vllm):
    """auto's first choice on a GPU is vLLM's engine (the stand-in, built for the
    device asked); on a CPU it never is, even where a vLLM is installed."""
    monkeypatch.setenv("VLLM_STAND_IN_DEVICE", "cuda")
    monkeypatch.setattr(engine_choice, "free_memory", lambda device: 2**40)
    model = tiny_llama(tokenizer)
    gpu = SimpleNamespace(unwrap_model=lambda m: m, num_processes=2, device=torch.device("cuda"))
    picked = choose_engine("auto", gpu, Sharding(), model)
    assert (picked.name, picked.why) == ("vllm", "vLLM is installed for cuda")
    monkeypatch.setenv("VLLM_STAND_IN_DEVICE", "cpu")
    cpu = SimpleNamespace(unwrap_model=lambda m: m, num_processes=2, device=torch.device("cpu"))
    assert choose_engine("auto", cpu, Sharding(), model).name == "replica"


def test_lora_vllm_cannot_merge_is_refused_in_one_line(tmp_path):
    """LoRA on a mixture of experts' fused expert weights is not a linear
    layer's: refused before the engine starts. On the same model's attention
    it merges as peft does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.objectives.vllm_engine import check_mergeable, merged_weights
    from tests.sft_models import save_family_model

    model = AutoModelForCausalLM.from_pretrained(save_family_model(tmp_path / "moe", "qwen3_moe"))
    experts = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules="all-linear",
                                                              lora_dropout=0.0))
    with pytest.raises(UsageError, match=r"--generation_engine vllm loads each adapted layer's weight with its LoRA "
                                         r"adapters merged, and model\.layers\.0\.mlp\.experts holds another kind "
                                         r"\(ParamWrapper\); pass --generation_engine auto"):
        check_mergeable(experts)
    attention = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    check_mergeable(attention)
    with torch.no_grad():
        for name, p in attention.named_parameters():
            if "lora_B" in name:
                p.add_(0.3)
    sent = dict(merged_weights(attention, ((n, p.detach()) for n, p in attention.named_parameters())))
    expected = dict(copy.deepcopy(attention).merge_and_unload().named_parameters())
    assert sorted(sent) == sorted(expected) and all(torch.allclose(sent[n], t, atol=1e-6) for n, t in expected.items())


def test_vllm_built_for_another_device_is_refused_in_one_line(monkeypatch, stand_in_vllm):
    """vLLM's engine must share the trainer's device: the stand-in reports a
    GPU build to a CPU run, as vLLM's CUDA wheel does on a machine without one."""
    from finetune.objectives import vllm_engine

    monkeypatch.setenv("VLLM_STAND_IN_DEVICE", "cuda")
    cpu = SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(UsageError, match=r"vLLM here runs on cuda and this run trains on cpu: .*; install the vLLM "
                                         r"build for it, or pass --generation_engine auto"):
        vllm_engine.refusal_or_reason(cpu, asked=True)
    stand_in_vllm()  # imported again, now for the CPU
    monkeypatch.setenv("VLLM_STAND_IN_DEVICE", "cpu")
    assert vllm_engine.refusal_or_reason(cpu, asked=True) == "as asked"
