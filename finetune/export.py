"""Writing a Hugging Face model dir from a full state dict: safetensors only,
split into shards with an index when large, tied weights stored once, written
to a temporary dir and renamed into place when complete.

Both the end-of-training consolidation (`RUN_DIR/final`) and `finetune export`
go through `write_model_dir`. `export_checkpoint` merges the DCP shards of a
checkpoint in one process on CPU, with no process group, long after training.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from finetune import models
from finetune.checkpoint import MODEL_CONFIG_DIR, MODEL_SHARDS_DIR, check_dcp_files, complete_checkpoints
from finetune.errors import UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """The architecture a config describes, without memory (works for any size)."""
    with torch.device("meta"):
        return models.from_config(config)


def tied_duplicates(model: torch.nn.Module) -> dict[str, str]:
    """Map each tied parameter name to the name it shares storage with."""
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
    parent = out_dir.absolute().parent
    existing = next(p for p in [parent, *parent.parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise UsageError(f"cannot write to {out_dir} ({existing} is not a writable directory); choose another --output")


def write_model_files(target: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase | None = None,
                      generation_config: GenerationConfig | None = None) -> None:
    """Everything of a model dir but its weights: config, generation config
    (generative models only), tokenizer (text models only)."""
    config.save_pretrained(target)
    if models.task_of_config(config) == "causal-lm":  # the generative models this tool trains
        (generation_config or GenerationConfig.from_model_config(config)).save_pretrained(target)
    if tokenizer is not None:
        tokenizer.save_pretrained(target)


def write_model_dir(state_dict: dict[str, torch.Tensor], config: PretrainedConfig, out_dir: str | Path, *,
                    tokenizer: PreTrainedTokenizerBase | None = None,
                    generation_config: GenerationConfig | None = None,
                    dtype: str = "float32", max_shard_size: str | int = "2GB", overwrite: bool = False) -> Path:
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    torch_dtype = DTYPES[dtype]

    duplicates = tied_duplicates(meta_model(config))
    tensors = {}
    for name in list(state_dict):
        if name in duplicates and duplicates[name] in state_dict:
            continue  # stored once, under the name the model ties it to
        tensor = state_dict[name].detach().to("cpu")
        if tensor.is_floating_point():
            tensor = tensor.to(torch_dtype)
        tensors[name] = tensor.contiguous()  # no copy when already fp32, contiguous and on CPU

    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise UsageError(f"cannot write to {out_dir} ({e.strerror}); choose another --output") from None
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
        write_model_files(tmp, config, tokenizer, generation_config)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def find_model_weights(path: str | Path) -> Path:
    """A run dir means its newest complete checkpoint; a checkpoint dir its
    `pytorch_model_fsdp_0` (or `model.safetensors` for unsharded runs)."""
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"{path} does not exist; pass a run dir or a checkpoints/step_NNNNNN dir")
    if (path / "checkpoints").is_dir():
        found = complete_checkpoints(path)
        if not found:
            raise UsageError(f"run dir {path} holds no complete checkpoint; pass a run that saved one")
        path = found[-1]
    for candidate in (path / MODEL_SHARDS_DIR, path / "model.safetensors", path):
        if candidate.name == "model.safetensors" and candidate.is_file():
            return candidate
        if candidate.is_dir() and (candidate / ".metadata").is_file():
            return candidate
    raise UsageError(f"{path} holds no checkpoint ({MODEL_SHARDS_DIR}/ with DCP shards, or model.safetensors); "
                     "pass a run dir or a checkpoints/step_NNNNNN dir")


def load_full_state_dict(weights: Path) -> dict[str, torch.Tensor]:
    """Merge DCP shards (any number of ranks) into one CPU state dict."""
    if weights.is_file():
        return load_file(str(weights))
    check_dcp_files(weights)
    merged: dict = {}
    _load_state_dict(merged, storage_reader=torch.distributed.checkpoint.FileSystemReader(str(weights)),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return merged["model"] if set(merged) == {"model"} else merged


def export_checkpoint(source: str | Path, output: str | Path, dtype: str = "float32", overwrite: bool = False,
                      model: str | None = None, max_shard_size: str | int = "2GB") -> Path:
    output = Path(output)
    check_output_dir(output, overwrite)  # before the (possibly long) merge
    weights = find_model_weights(source)
    checkpoint_dir = weights.parent
    model_files = checkpoint_dir / MODEL_CONFIG_DIR
    config_source = model or (str(model_files) if model_files.is_dir() else None)
    if config_source is None:
        raise UsageError(f"{checkpoint_dir} has no {MODEL_CONFIG_DIR}/ (not written by finetune); pass --model with "
                         "the HF model dir or id it was trained from, for its config and tokenizer")
    try:
        config = AutoConfig.from_pretrained(config_source)
        is_text = models.task_of_config(config) == "causal-lm"
        tokenizer = AutoTokenizer.from_pretrained(config_source) if is_text else None
    except (OSError, ValueError) as e:
        raise UsageError(f"could not read the model config/tokenizer from {config_source} "
                         f"({str(e).strip().splitlines()[0]}); pass --model with a HF model dir") from None
    try:
        generation_config = GenerationConfig.from_pretrained(config_source)
    except OSError:
        generation_config = None
    state_dict = load_full_state_dict(weights)
    return write_model_dir(state_dict, config, output, tokenizer=tokenizer, generation_config=generation_config,
                           dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite)
