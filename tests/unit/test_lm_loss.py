"""What makes a training step lighter computes the same thing: the chunked
cross-entropy (finetune/tasks/lm_loss.py) against the full logits, the
completions' logits alone against the whole ones, and the
one-kernel GELU (finetune/models: fuse_activations) against gelu_new."""

from __future__ import annotations

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM)

from finetune.errors import UsageError
from finetune.models import fuse_activations
from finetune.tasks.lm_loss import (IGNORE, can_chunk, chunked_head_loss, completion_logits, full_logits_nll,
                                    next_token_targets)

VOCAB = 97


def gpt2_tied():
    # No dropout: the two forwards compared must be the same function.
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=24, n_layer=2, n_head=2, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def llama_untied():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False))


def llama_head_with_bias():
    model = llama_untied()
    model.lm_head = torch.nn.Linear(24, VOCAB, bias=True)
    torch.nn.init.normal_(model.lm_head.bias)
    return model


def assert_close_to_scale(got: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """Equal to 1e-6 of the tensor's largest magnitude (fp32 sums in another order)."""
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()), msg=name or None)


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_next_token_targets_shift_the_labels_and_ignore_the_last_position():
    labels = torch.tensor([[5, 6, -100, 8]])
    assert next_token_targets(labels).tolist() == [[6, -100, 8, -100]]
    logits = torch.randn(1, 4, 11)
    nll = full_logits_nll(logits.bfloat16(), next_token_targets(torch.randint(0, 11, (1, 4))))
    assert nll.dtype == torch.float32 and nll[0, -1] == 0  # fp32 whatever the logits' dtype


@pytest.mark.parametrize("build", [gpt2_tied, llama_untied, llama_head_with_bias])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk_size", [5, 1000])
def test_chunked_loss_and_gradients_equal_the_full_logits(build, masked, chunk_size):
    torch.manual_seed(0)
    model = build().float()
    model.train()
    ids = torch.randint(0, VOCAB, (3, 16))
    labels = ids.clone()
    if masked:  # a prompt without targets, and a row of padding
        labels[:, :6] = -100
        labels[2, 10:] = -100
    targets = next_token_targets(labels)
    inputs = {"input_ids": ids, "use_cache": False}

    full_nll = full_logits_nll(model(**inputs).logits, targets)
    full_nll.sum().backward()
    expected = gradients(model)
    model.zero_grad(set_to_none=True)

    total, nll = chunked_head_loss(model, inputs, targets, chunk_size)
    total.backward()
    torch.testing.assert_close(nll, full_nll.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(total.detach(), full_nll.sum().detach(), rtol=1e-6, atol=1e-6)
    got = gradients(model)
    assert got.keys() == expected.keys()
    for name in expected:
        assert_close_to_scale(got[name], expected[name], name)
    if masked:
        assert (nll[targets == -100] == 0).all()


def test_a_scaled_loss_scales_the_gradients():
    """Backward multiplies the stored gradients by the incoming one (the loop divides by a count)."""
    torch.manual_seed(0)
    model = llama_untied()
    ids = torch.randint(0, VOCAB, (2, 8))
    inputs, targets = {"input_ids": ids, "use_cache": False}, next_token_targets(ids)
    (full_logits_nll(model(**inputs).logits, targets).sum() / 7).backward()
    expected = gradients(model)
    model.zero_grad(set_to_none=True)
    (chunked_head_loss(model, inputs, targets, 4)[0] / 7).backward()
    for name, grad in gradients(model).items():
        assert_close_to_scale(grad, expected[name], name)


def test_without_grad_the_chunked_nll_is_the_evaluation_nll():
    torch.manual_seed(0)
    model = gpt2_tied().eval()
    ids = torch.randint(0, VOCAB, (2, 8))
    inputs, targets = {"input_ids": ids, "use_cache": False}, next_token_targets(ids)
    with torch.no_grad():
        total, nll = chunked_head_loss(model, inputs, targets, 3)
        torch.testing.assert_close(nll, full_logits_nll(model(**inputs).logits, targets), rtol=1e-6, atol=1e-6)
    assert not total.requires_grad


def test_a_model_that_transforms_its_scores_uses_the_full_logits_or_is_refused():
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=12,
                                           max_position_embeddings=32, final_logit_softcapping=30.0))
    assert not can_chunk(model)  # known: soft-capping after the head
    assert can_chunk(gpt2_tied()) and can_chunk(llama_untied())
    ids = torch.randint(0, VOCAB, (2, 8))
    # Unknown to can_chunk: the model's own output differs from the head's, so it is refused, not silently wrong.
    with pytest.raises(UsageError, match="--loss_chunk_size 0"):
        chunked_head_loss(model, {"input_ids": ids, "use_cache": False}, next_token_targets(ids), 4)


def saved_for_backward_bytes(model, ids) -> int:
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())  # storages, so a view of an input is not counted twice
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    return sum(saved)


@pytest.mark.parametrize("activation", ["gelu_new", "gelu_fast"])
def test_fused_gelu_is_the_same_function_and_keeps_less_for_backward(activation):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=24, n_layer=2, n_head=2,
                                       activation_function=activation, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, VOCAB, (2, 16))
    before = saved_for_backward_bytes(model, ids)
    logits, grads = model(input_ids=ids).logits.detach(), gradients(model)  # of logits.sum(), as after
    model.zero_grad(set_to_none=True)

    assert fuse_activations(model) == 2  # one per block
    assert model.config.activation_function == activation  # exports keep the model's own name
    after = saved_for_backward_bytes(model, ids)
    assert_close_to_scale(model(input_ids=ids).logits.detach(), logits)
    for name, grad in gradients(model).items():
        assert_close_to_scale(grad, grads[name], name)
    # Per block, gelu_new keeps 4 to 5 extra [tokens, 4 x width] tensors; the kernel none beyond its input.
    assert before - after >= 2 * 3 * ids.numel() * 4 * 24 * 4


def test_diverged_weights_give_a_nan_loss_not_a_refusal():
    """NaN scores are equal to themselves here: the loop reports the non-finite loss."""
    model = llama_untied()
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    ids = torch.randint(0, VOCAB, (2, 8))
    total, _ = chunked_head_loss(model, {"input_ids": ids, "use_cache": False}, next_token_targets(ids), 4)
    assert total.isnan()


@pytest.mark.parametrize("precision", ["autocast", "bf16 parameters"])
def test_in_bf16_the_chunked_loss_follows_the_full_one(precision):
    """bf16 matmuls as accelerate's autocast (DDP, one process) or FSDP2's
    bf16 parameters run them; the scores and the loss in fp32 either way."""
    torch.manual_seed(0)
    model = llama_untied()
    if precision == "bf16 parameters":
        model = model.bfloat16()
    ids = torch.randint(0, VOCAB, (2, 16))
    inputs, targets = {"input_ids": ids, "use_cache": False}, next_token_targets(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        full = full_logits_nll(model(**inputs).logits, targets).sum()
        full.backward()
        expected = gradients(model)
        model.zero_grad(set_to_none=True)
        total, nll = chunked_head_loss(model, inputs, targets, 5)
        total.backward()
    assert total.dtype == nll.dtype == torch.float32
    torch.testing.assert_close(total.detach(), full.detach(), rtol=1e-2, atol=0)
    for name, grad in gradients(model).items():
        assert grad.dtype == expected[name].dtype
        scale = float(expected[name].float().abs().max())
        torch.testing.assert_close(grad.float(), expected[name].float(), rtol=0, atol=0.05 * scale, msg=name)


def test_completion_logits_score_from_the_first_labelled_position_and_agree_with_the_whole(tmp_path):
    """A preference batch's log-probs from the completions' logits alone (the
    model's logits_to_keep) equal those from every position's; under LoRA too,
    whose wrapper passes the argument on."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    ids = torch.randint(1, VOCAB, (3, 12))
    labels = torch.full_like(ids, IGNORE)
    labels[0, 7:], labels[1, 5:9], labels[2, 9:] = ids[0, 7:], ids[1, 5:9], ids[2, 9:]
    targets = next_token_targets(labels)
    for model in (llama_untied(), get_peft_model(llama_untied(), LoraConfig(r=2, target_modules=["q_proj"]))):
        logits, kept = completion_logits(model, {"input_ids": ids}, targets)
        assert logits.shape[1] == kept.shape[1] == 12 - 4  # position 4's target is the first label, at 5
        whole = model(input_ids=ids).logits
        assert torch.allclose(-full_logits_nll(logits, kept).sum(-1), -full_logits_nll(whole, targets).sum(-1),
                              rtol=1e-5, atol=1e-5)
    everywhere = next_token_targets(ids)
    logits, kept = completion_logits(llama_untied(), {"input_ids": ids}, everywhere)
    assert logits.shape[1] == 12 and kept is everywhere  # a target at the first position: nothing to leave out
