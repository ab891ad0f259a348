"""Unit tests of pretrained weights read into each rank's shards."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from finetune.errors import UsageError


def test_own_shards_read_what_from_pretrained_loads(tmp_path):
    """A GPT-2 stored as the Hub's gpt2 is (no `transformer.` prefix, the tied
    head left out) and a GPT-NeoX (stored `embed_out`, loaded as `lm_head`):
    every tensor read from the files equals from_pretrained's, and a file
    whose names transformers would not load is left to from_pretrained."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig

    from finetune.models import placeholder_model
    from finetune.shard_loading import OwnShards

    torch.manual_seed(0)
    for config in (GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32),
                   GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 vocab_size=64, max_position_embeddings=32)):
        path = tmp_path / config.model_type
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        if config.model_type == "gpt2":
            stored = load_file(path / "model.safetensors")
            save_file({k.removeprefix("transformer."): v for k, v in stored.items()}, path / "model.safetensors",
                      metadata={"format": "pt"})
        expected = AutoModelForCausalLM.from_pretrained(path).state_dict()
        own = OwnShards.for_model(str(path), config, AutoModelForCausalLM, trust_remote_code=False)
        assert own is not None
        model = placeholder_model(config, AutoModelForCausalLM, torch.float32, trust_remote_code=False)
        own.fill(model)
        got = model.state_dict()
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight or config.model_type != "gpt2"

    stored = load_file(tmp_path / "gpt2" / "model.safetensors")
    save_file({"renamed." + k: v for k, v in stored.items()}, tmp_path / "gpt2" / "model.safetensors")
    assert OwnShards.for_model(str(tmp_path / "gpt2"), config=GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64,
                                                                        n_positions=32),
                               auto_class=AutoModelForCausalLM, trust_remote_code=False) is None


def test_bf16_loaded_weights_held_in_fp32_without_writing_the_placeholders(tmp_path):
    """--model_dtype bfloat16 under mixed precision: the trainable parameters
    are fp32 before sharding (as Accelerate would upcast them), an unwritten
    placeholder stays unwritten (no fp32 model per rank), and the rows read
    into it are the files' values rounded to bf16, as from_pretrained loads them."""
    from transformers import LlamaConfig

    from finetune.host_memory import resident_bytes
    from finetune.models import placeholder_model, upcast_trainable
    from finetune.shard_loading import OwnShards

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, max_position_embeddings=32)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")  # fp32 files
    files = load_file(tmp_path / "llama" / "model.safetensors")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).state_dict()
    model = placeholder_model(config, AutoModelForCausalLM, torch.bfloat16, trust_remote_code=False)
    upcast_trainable(model, written=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    OwnShards.for_model(str(tmp_path / "llama"), config, AutoModelForCausalLM, False, torch.bfloat16).fill(model)
    got = model.state_dict()
    assert all(torch.equal(got[k], expected[k].float()) for k in expected)
    assert any(not torch.equal(got[k], files[k]) for k in files)  # rounded through bf16 indeed

    big = placeholder_model(LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                                        num_attention_heads=8, vocab_size=1024), AutoModelForCausalLM, torch.bfloat16,
                            trust_remote_code=False)  # 0.4 GB in fp32
    before = resident_bytes()
    upcast_trainable(big, written=False)
    assert resident_bytes() - before < 50 * 2**20
    assert all(p.dtype == torch.float32 for p in big.parameters())


@pytest.mark.parametrize("named", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/model.safetensors", 7])
def test_an_index_that_names_files_outside_its_dir_is_refused(tmp_path, named):
    """A model dir may come from anyone: its index names the files beside it, nothing else."""
    from safetensors.torch import save_file

    from finetune.models import check_model_files
    from finetune.shard_loading import stored_tensors

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    save_file({"v": torch.zeros(2)}, str(model_dir / "model-00001-of-00001.safetensors"))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"v": "model-00001-of-00001.safetensors", "w": named}}))
    for read in (stored_tensors, lambda d: check_model_files(d, "--model")):
        with pytest.raises(UsageError, match="which is not a file in .*an index names the files beside it"):
            read(model_dir)
