"""`finetune export`: merge the model of a checkpoint (the sharded layout of
any backend, written by any number of ranks) in one process on CPU, with no
process group, long after training, and write it as a Hugging Face model dir
(model_dir.py). Each backend reads its own layout (finetune/backends).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

import finetune.models.cnn_config  # noqa: F401  (registers the lecture CNN's config with AutoConfig)

from finetune.backends import REGISTRY as BACKENDS, weights_in
from finetune.backends.base import Backend
from finetune.checkpoint import MODEL_CONFIG_DIR, complete_checkpoints, read_progress, saved_config
from finetune.config import data_options, load_config
from finetune.errors import UsageError
from finetune.model_dir import Weights, atomic_dir, check_output_dir, read_tied, write_model_dir
from finetune.models.gguf import converted_dir, is_gguf
from finetune.models.lora import ADAPTER_CONFIG, BASE_RECORD
from finetune.tasks import task_for_config
from finetune.verify import verify_manifest


def find_model_weights(path: str | Path) -> tuple[Backend, Path]:
    """A run dir means its newest complete checkpoint; a checkpoint dir the
    model weights in it, with the backend whose layout they are in."""
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"{path} does not exist; pass a run dir or a checkpoints/step_NNNNNN dir")
    if (path / "checkpoints").is_dir():
        found = complete_checkpoints(path)
        if not found:
            raise UsageError(f"run dir {path} holds no complete checkpoint; pass a run that saved one")
        path = found[-1]
    if (found := weights_in(path)) is None:
        layouts = ", ".join(dict.fromkeys(backend.weights_described for backend in BACKENDS))
        raise UsageError(f"{path} holds no checkpoint ({layouts}); "
                         "pass a run dir or a checkpoints/step_NNNNNN dir")
    return found


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
    backend, weights = find_model_weights(source)
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
        return write_adapter_dir(checkpoint_dir, backend.export_weights(weights), output)
    model_weights = (merged_weights(checkpoint_dir, backend.export_weights(weights), tokenizer, base_model) if adapters
                     else backend.export_weights(weights))
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
