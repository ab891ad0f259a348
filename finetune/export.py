"""`finetune export`: merge the DCP shards of a checkpoint (any number of
ranks), or DeepSpeed's partitions, in one process on CPU, with no process
group, long after training, and write them as a Hugging Face model dir
(model_dir.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

import finetune.models.cnn_config  # noqa: F401  (registers the lecture CNN's config with AutoConfig)

from finetune.checkpoint import (DEEPSPEED_DIR, MODEL_CONFIG_DIR, MODEL_SHARDS_DIR, check_deepspeed_files,
                                 complete_checkpoints, read_progress, saved_config)
from finetune.config import data_options, load_config
from finetune.errors import UsageError
from finetune.model_dir import Weights, atomic_dir, check_output_dir, read_tied, write_model_dir
from finetune.models.gguf import converted_dir, is_gguf
from finetune.models.lora import ADAPTER_CONFIG, BASE_RECORD
from finetune.shard_loading import SAFETENSORS_DTYPES
from finetune.tasks import task_for_config
from finetune.verify import check_dcp_dir, deepspeed_loads_weights_only, verify_manifest


def find_model_weights(path: str | Path) -> Path:
    """A run dir means its newest complete checkpoint; a checkpoint dir its
    `pytorch_model_fsdp_0` (DeepSpeed's `pytorch_model`, or `model.safetensors`
    for unsharded runs)."""
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"{path} does not exist; pass a run dir or a checkpoints/step_NNNNNN dir")
    if (path / "checkpoints").is_dir():
        found = complete_checkpoints(path)
        if not found:
            raise UsageError(f"run dir {path} holds no complete checkpoint; pass a run that saved one")
        path = found[-1]
    if (path / DEEPSPEED_DIR).is_dir():
        return path / DEEPSPEED_DIR
    for candidate in (path / MODEL_SHARDS_DIR, path / "model.safetensors", path):
        if candidate.name == "model.safetensors" and candidate.is_file():
            return candidate
        if candidate.is_dir() and (candidate / ".metadata").is_file():
            return candidate
    raise UsageError(f"{path} holds no checkpoint ({MODEL_SHARDS_DIR}/ with DCP shards, {DEEPSPEED_DIR}/ from "
                     "DeepSpeed, or model.safetensors); "
                     "pass a run dir or a checkpoints/step_NNNNNN dir")


def checkpoint_weights(weights: Path) -> Weights:
    """The tensors of a checkpoint's model, read a few at a time: from DCP
    shards (any number of ranks), only the byte ranges of the tensors asked
    for, or from a single safetensors file. DeepSpeed's partitions are
    consolidated whole in memory, in fp32, by DeepSpeed's own zero_to_fp32."""
    if weights.name == DEEPSPEED_DIR and weights.is_dir():
        return deepspeed_weights(weights.parent)
    if weights.is_file():
        with safe_open(str(weights), "pt") as f:
            specs = {name: (torch.Size(f.get_slice(name).get_shape()), SAFETENSORS_DTYPES[f.get_slice(name).get_dtype()])
                     for name in f.keys()}

        def read_file(names: list[str]) -> dict[str, torch.Tensor]:
            with safe_open(str(weights), "pt") as f:
                return {name: f.get_tensor(name) for name in names}
        return Weights(specs, read_file)
    metadata = check_dcp_dir(weights)  # read without unpickling anything but DCP's metadata
    tensors = {fqn: meta for fqn, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    # Accelerate saves {"model": state_dict}: every key path is ("model", name).
    paths = metadata.planner_data or {}
    nested = tensors and all(len(paths.get(fqn, ())) == 2 and paths[fqn][0] == "model" for fqn in tensors)
    fqn_of = {(paths[fqn][1] if nested else fqn): fqn for fqn in tensors}

    def read_shards(names: list[str]) -> dict[str, torch.Tensor]:
        # Empty tensors of the saved shapes and dtypes, filled in place by DCP's public loader.
        part = {fqn_of[name]: torch.empty(tensors[fqn_of[name]].size, dtype=tensors[fqn_of[name]].properties.dtype)
                for name in names}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(part, storage_reader=dcp.FileSystemReader(str(weights)),
                     planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        return {name: part[fqn_of[name]] for name in names}
    return Weights({name: (tensors[fqn].size, tensors[fqn].properties.dtype) for name, fqn in fqn_of.items()},
                   read_shards)


def deepspeed_weights(checkpoint_dir: Path) -> Weights:
    check_deepspeed_files(checkpoint_dir)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with deepspeed_loads_weights_only():
        state_dict = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=DEEPSPEED_DIR)
    return Weights.in_memory(state_dict)


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
                      model: str | None = None, max_shard_size: int = 2 * 10**9, adapter_only: bool = False) -> Path:
    """The checkpoint as a HF model dir; a LoRA run's with its adapters merged
    into the base, or (adapter_only) as a peft adapter dir."""
    output = Path(output)
    check_not_inside(output, Path(source))
    check_output_dir(output, overwrite)  # before the (possibly long) merge
    weights = find_model_weights(source)
    checkpoint_dir = weights.parent
    # What the export reads, against the checksums the checkpoint recorded (checkpoints without a manifest predate them).
    verify_manifest(checkpoint_dir, under=(weights.name, MODEL_CONFIG_DIR))
    model_files = checkpoint_dir / MODEL_CONFIG_DIR
    adapters = (model_files / ADAPTER_CONFIG).is_file()  # a LoRA run's: the adapters, without their base
    if adapter_only and not adapters:
        raise UsageError(f"{checkpoint_dir} is a full fine-tune's checkpoint: it holds the whole model and no "
                         "adapters; export it without --adapter_only")
    base_model, model = (model, None) if adapters else (None, model)  # --model: the base to merge into, for LoRA
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
    if adapters and adapter_only:
        return write_adapter_dir(checkpoint_dir, checkpoint_weights(weights), output)
    model_weights = (merged_weights(checkpoint_dir, checkpoint_weights(weights), tokenizer, base_model) if adapters
                     else checkpoint_weights(weights))
    tied = read_tied(model_files) if config_source == str(model_files) and not adapters else None
    try:
        return write_model_dir(model_weights, config, output, tokenizer=tokenizer, generation_config=generation_config,
                               run_data=run_data(checkpoint_dir), dtype=dtype,
                               max_shard_size=max_shard_size, overwrite=overwrite, tied=tied)
    except (OSError, SafetensorError) as e:  # a full disk, a read-only dir; the temporary dir is already gone
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
        raise UsageError(f"could not write {output} ({reason}); it was left as it was: free space or choose another "
                         "--output") from None


def write_adapter_dir(checkpoint_dir: Path, adapter: Weights, output: Path) -> Path:
    """adapter_config.json + adapter_model.safetensors, which `PeftModel.from_pretrained(base, output)` loads."""
    from peft import LoraConfig

    from finetune.models.lora import read_base_record, write_adapter

    config = LoraConfig.from_pretrained(str(checkpoint_dir / MODEL_CONFIG_DIR))
    base = read_base_record(checkpoint_dir / MODEL_CONFIG_DIR / BASE_RECORD)
    with atomic_dir(output) as tmp:
        write_adapter(adapter.fetch(list(adapter.specs)), config, tmp, base_model=base.get("model", ""))
    return output


def merged_weights(checkpoint_dir: Path, adapter: Weights, tokenizer, base_model: str | None) -> dict[str, torch.Tensor]:
    """The run's base (or --model), checked against the one the adapters were
    trained on, with the adapters merged in by peft. The base is held whole in
    memory once, in fp32."""
    from peft import LoraConfig

    from finetune.models.lora import base_record, check_same_base, merged_state_dict, read_base_record
    from finetune.tasks.base import build_task

    recorded = read_base_record(checkpoint_dir / MODEL_CONFIG_DIR / BASE_RECORD)
    cfg = load_config(checkpoint_dir / "run_config.yaml", {"model": base_model} if base_model else {})
    task = build_task(cfg)
    if is_gguf(cfg.model):
        task.model_source = str(converted_dir(cfg.model))
    base = task.base_model(tokenizer)
    check_same_base(recorded, base_record(task.model_source, base), checkpoint_dir)
    config = LoraConfig.from_pretrained(str(checkpoint_dir / MODEL_CONFIG_DIR))
    return merged_state_dict(base, adapter.fetch(list(adapter.specs)), config)
