"""Unit tests of the attention kernels a causal LM trains with
(finetune/models/attention.py) and the inputs each gets (tasks/causal_lm.py)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from finetune.data.chat import PadCollator, pack
from finetune.data.preference import PairCollator
from finetune.errors import UsageError
from finetune.models.attention import use_attention
from finetune.tasks.causal_lm import model_inputs
from finetune.tasks.lm_loss import IGNORE, full_logits_nll, next_token_targets


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def examples(lengths: list[int]) -> Dataset:
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, 96, (n,), generator=generator).tolist() for n in lengths]
    return Dataset.from_dict({"input_ids": ids, "labels": [[IGNORE, *row[1:]] for row in ids]})


def packed_batch() -> dict:
    """SFT's (and a stream's) packed rows: several examples per row, position
    ids restarting at each, the rows padded to the longest."""
    blocks = pack(examples([9, 7, 5, 4, 3, 2, 6]), block_size=16)
    return PadCollator(pad_id=0)([dict(zip(blocks.column_names, row)) for row in zip(*blocks.to_dict().values())])


def pair_batch() -> dict:
    """DPO's 2B sequences: the chosen sides, then the rejected, padded."""
    rows = examples([8, 5, 11, 6]).to_dict()
    pairs = [{"pair": i, "chosen_input_ids": rows["input_ids"][2 * i], "chosen_labels": rows["labels"][2 * i],
              "rejected_input_ids": rows["input_ids"][2 * i + 1], "rejected_labels": rows["labels"][2 * i + 1]}
             for i in range(2)]
    return PairCollator(pad_id=0)(pairs)


@torch.no_grad()  # a CPU has no flex-attention backward: the comparison is of forwards
@pytest.mark.parametrize("make_batch", [packed_batch, pair_batch], ids=["packed SFT or stream rows", "DPO pairs"])
def test_flex_attention_without_a_mask_scores_every_example_as_the_dense_mask_does(make_batch):
    # Each case compiles flex attention for its own shape: torch 2.13's CPU code for a recompile with dynamic
    # shapes does not build (GPUs compile it through triton instead).
    torch._dynamo.reset()
    model, batch = tiny_llama(), make_batch()
    assert batch["position_ids"].eq(0).sum() > batch["position_ids"].size(0)  # several examples or padding per row
    dense_inputs = model_inputs(model, batch)
    assert dense_inputs["attention_mask"].shape == (*batch["input_ids"].shape[:1], 1, *batch["input_ids"].shape[1:2] * 2)
    dense = model(**dense_inputs).logits
    assert use_attention(model, "flex_attention") == "flex_attention"
    flex_inputs = model_inputs(model, batch)
    assert "attention_mask" not in flex_inputs  # no [B, 1, T, T] tensor: the document mask comes from the position ids
    flex = model(**flex_inputs).logits
    real = batch["attention_mask"].bool()
    assert torch.allclose(flex[real], dense[real], atol=1e-5, rtol=0)
    targets = next_token_targets(batch["labels"])
    example = (batch["position_ids"] == 0).cumsum(-1)  # each example's (and each pad's) own number in its row
    for row in range(batch["input_ids"].size(0)):
        for n in example[row].unique():
            here = (example[row] == n).unsqueeze(0)
            per_example = [full_logits_nll(logits[row:row + 1], targets[row:row + 1])[here].sum() for logits in (flex, dense)]
            assert torch.allclose(*per_example, atol=1e-5, rtol=0)


@torch.no_grad()
def test_the_dense_mask_keeps_examples_apart_as_if_each_were_alone():
    """What both paths are held to: a packed example's logits are its logits alone."""
    model, batch = tiny_llama(), packed_batch()
    logits = model(**model_inputs(model, batch)).logits
    positions = batch["position_ids"][0]
    starts = [i for i in range(len(positions)) if positions[i] == 0] + [int(batch["attention_mask"][0].sum())]
    for start, end in zip(starts, starts[1:]):
        alone = model(input_ids=batch["input_ids"][:1, start:end], use_cache=False).logits
        assert torch.allclose(alone[0], logits[0, start:end], atol=1e-5, rtol=0)


def test_auto_is_sdpa_on_a_cpu_and_a_kernel_a_family_lacks_is_one_line():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=4, n_positions=32))
    if not torch.cuda.is_available():
        assert use_attention(model, "auto") == "sdpa" and model.config._attn_implementation == "sdpa"
    with pytest.raises(UsageError, match=r"^--attn_implementation flex_attention: GPT2LMHeadModel cannot use it \(.*"
                                         r"\); pass --attn_implementation sdpa"):
        use_attention(model, "flex_attention")
    assert use_attention(model, "eager") == "eager"
    assert model_inputs(model, packed_batch())["attention_mask"].dtype == torch.float32  # eager adds it to the scores
