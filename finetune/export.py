"""Writing a Hugging Face model dir from a full state dict: safetensors only,
split into shards with an index when large, tied weights stored once, written
to a temporary dir and renamed into place when complete.

Both the end-of-training consolidation (`RUN_DIR/final`) and `finetune export`
go through `write_model_dir`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from finetune.errors import UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def tied_duplicates(config: PretrainedConfig) -> dict[str, str]:
    """Map each tied parameter name to the name it shares storage with, found by
    building the model on the meta device (no memory, works for any architecture)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    first_name: dict[int, str] = {}
    duplicates = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            duplicates[name] = first_name[id(param)]
        else:
            first_name[id(param)] = name
    return duplicates


def check_output_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise UsageError(f"output dir {out_dir} exists and is not empty; pass --overwrite or choose another --output")
    parent = out_dir.parent if out_dir.parent != Path("") else Path(".")
    existing = next((p for p in [parent, *parent.parents] if p.exists()), Path("/"))
    if not os.access(existing, os.W_OK):
        raise UsageError(f"cannot write to {out_dir} ({existing} is not writable); choose another --output")


def write_model_dir(state_dict: dict[str, torch.Tensor], config: PretrainedConfig, out_dir: str | Path, *,
                    tokenizer: PreTrainedTokenizerBase | None = None,
                    generation_config: GenerationConfig | None = None,
                    dtype: str = "float32", max_shard_size: str | int = "2GB", overwrite: bool = False) -> Path:
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    torch_dtype = DTYPES[dtype]

    duplicates = tied_duplicates(config)
    tensors = {}
    for name, tensor in state_dict.items():
        if name in duplicates and duplicates[name] in state_dict:
            continue  # stored once, under the name the model ties it to
        tensor = tensor.detach().to("cpu")
        if tensor.is_floating_point():
            tensor = tensor.to(torch_dtype)
        tensors[name] = tensor.contiguous().clone()

    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=max_shard_size)
        for filename, names in split.filename_to_tensors.items():
            save_file({n: tensors[n] for n in names}, str(tmp / filename), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                     "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        config = config.__class__.from_dict(config.to_dict())
        config.dtype = dtype
        config.save_pretrained(tmp)
        (generation_config or GenerationConfig.from_model_config(config)).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
