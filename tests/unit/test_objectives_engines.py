"""The generation engines (finetune/objectives/engines.py) in one process: a
replica samples what the model itself does, full and under LoRA, and again
after the trained weights move; auto's pick and the replica that cannot fit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from finetune.backends.base import Backend
from finetune.errors import UsageError
from finetune.objectives import engines
from finetune.objectives.engines import AsHeld, Replica, choose_engine
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
    monkeypatch.setattr(engines, "free_memory", lambda device: 10 * size)
    assert choose_engine("auto", accelerator, Sharding(), model).name == "replica"
    whole = choose_engine("auto", accelerator, Backend(), model)
    assert whole.name == "sharded" and "each rank holds the whole model" in whole.why
    monkeypatch.setattr(engines, "free_memory", lambda device: size + size // 2)
    assert choose_engine("auto", accelerator, Sharding(), model).name == "sharded"  # not in half of it
    assert choose_engine("replica", accelerator, Sharding(), model).name == "replica"  # asked, and it fits
    monkeypatch.setattr(engines, "free_memory", lambda device: size // 2)
    with pytest.raises(UsageError, match=r"--generation_engine replica keeps a whole copy of the policy .* pass "
                                         r"--generation_engine sharded"):
        choose_engine("replica", accelerator, Sharding(), model)
    assert type(engines.ENGINE_CLASSES["sharded"](accelerator, Backend())) is AsHeld
