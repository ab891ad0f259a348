"""`finetune export`: merge the DCP shards of a checkpoint (any number of
ranks) in one process on CPU, with no process group, long after training,
and write them as a Hugging Face model dir (model_dir.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

import finetune.models  # noqa: F401  (registers the lecture CNN's config with AutoConfig)

from finetune.checkpoint import (MODEL_CONFIG_DIR, MODEL_SHARDS_DIR, complete_checkpoints, read_progress,
                                 saved_config)
from finetune.config import data_options
from finetune.errors import UsageError
from finetune.model_dir import check_output_dir, write_model_dir
from finetune.tasks import task_for_config
from finetune.verify import check_dcp_dir, verify_manifest


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
    metadata = check_dcp_dir(weights)  # read without unpickling anything but DCP's metadata
    # Empty tensors of the saved shapes and dtypes, filled in place by DCP's public loader.
    merged = {fqn: torch.empty(meta.size, dtype=meta.properties.dtype)
              for fqn, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(merged, storage_reader=dcp.FileSystemReader(str(weights)), no_dist=True)
    # Accelerate saves {"model": state_dict}: every key path is ("model", name).
    paths = metadata.planner_data or {}
    if merged and all(len(paths.get(fqn, ())) == 2 and paths[fqn][0] == "model" for fqn in merged):
        return {paths[fqn][1]: tensor for fqn, tensor in merged.items()}
    return merged


def check_not_inside(output: Path, source: Path) -> None:
    """--overwrite replaces the output: it must never be the source, hold it, or lie inside it."""
    out, src = output.resolve(), source.resolve()
    if out == src or out in src.parents or src in out.parents:
        where = "the source" if out == src else "inside the source" if src in out.parents else "a dir holding the source"
        raise UsageError(f"--output {output} is {where} "
                         f"{source}; choose an --output outside it")


def run_data(checkpoint_dir: Path) -> dict | None:
    """The data record (config.data_options) of the run that wrote a checkpoint; None for another tool's."""
    saved = saved_config(checkpoint_dir)
    return data_options(saved, read_progress(checkpoint_dir).world_size) if saved else None


def export_checkpoint(source: str | Path, output: str | Path, dtype: str = "float32", overwrite: bool = False,
                      model: str | None = None, max_shard_size: str | int = "2GB") -> Path:
    output = Path(output)
    check_not_inside(output, Path(source))
    check_output_dir(output, overwrite)  # before the (possibly long) merge
    weights = find_model_weights(source)
    checkpoint_dir = weights.parent
    # What the export reads, against the checksums the checkpoint recorded (checkpoints without a manifest predate them).
    verify_manifest(checkpoint_dir, under=(weights.name, MODEL_CONFIG_DIR))
    model_files = checkpoint_dir / MODEL_CONFIG_DIR
    config_source = model or (str(model_files) if model_files.is_dir() else None)
    if config_source is None:
        raise UsageError(f"{checkpoint_dir} has no {MODEL_CONFIG_DIR}/ (not written by finetune); pass --model with "
                         "the HF model dir or id it was trained from, for its config and tokenizer")
    try:
        config = AutoConfig.from_pretrained(config_source, trust_remote_code=False)
        task = task_for_config(config)
        tokenizer = (AutoTokenizer.from_pretrained(config_source, trust_remote_code=False)
                     if task is not None and task.has_tokenizer else None)
    except (OSError, ValueError) as e:
        raise UsageError(f"could not read the model config/tokenizer from {config_source} "
                         f"({str(e).strip().splitlines()[0]}); pass --model with a HF model dir") from None
    try:
        generation_config = GenerationConfig.from_pretrained(config_source)
    except OSError:
        generation_config = None
    state_dict = load_full_state_dict(weights)
    try:
        return write_model_dir(state_dict, config, output, tokenizer=tokenizer, generation_config=generation_config,
                               run_data=run_data(checkpoint_dir), dtype=dtype,
                               max_shard_size=max_shard_size, overwrite=overwrite)
    except (OSError, SafetensorError) as e:  # a full disk, a read-only dir; the temporary dir is already gone
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
        raise UsageError(f"could not write {output} ({reason}); it was left as it was: free space or choose another "
                         "--output") from None
