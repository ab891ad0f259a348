"""`finetune export`: merge the model of a checkpoint (the sharded layout of
any backend, written by any number of ranks) in one process on CPU, with no
process group, long after training, and write it as a Hugging Face model dir
(model_dir.py), or (`--format gguf`) as one GGUF file (gguf_export.py). Each
backend reads its own layout (finetune/backends).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer

import finetune.models.cnn_config  # noqa: F401  (registers the lecture CNN's config with AutoConfig)

from finetune.model_dir import MODEL_CONFIG_DIR
from finetune.config import data_options, load_config
from finetune.errors import UsageError, missing_or_odd, why_it_cannot_be_made, write_failure_fix
from finetune.model_card import checkpoint_record, write_model_card
from finetune.model_dir import check_output_dir, read_generation_config, read_tied, write_model_dir
from finetune.models.gguf import converted_dir, is_gguf
from finetune.tasks import task_for_config
from finetune.manifest import verify_manifest

if TYPE_CHECKING:
    from finetune.backends.base import Backend

# A checkpoint's layouts are read by the backends (and torch.distributed.checkpoint):
# imported where a checkpoint is exported, never for a model dir.


def find_model_weights(path: str | Path) -> tuple[Backend, Path]:
    """A run dir means its newest complete checkpoint; a checkpoint dir the
    model weights in it, with the backend whose layout they are in."""
    from finetune.backends import REGISTRY as BACKENDS, weights_in
    from finetune.run_dir import complete_checkpoints

    path = Path(path)
    if not path.is_dir():
        what = missing_or_odd(path)
        raise UsageError(f"{path} {what}; pass a run dir or a checkpoints/step_NNNNNN dir")
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
    from finetune.checkpoint import read_progress
    from finetune.run_dir import saved_config

    saved = saved_config(checkpoint_dir)
    return data_options(saved, read_progress(checkpoint_dir).world_size) if saved else None


# A live run with --keep_last may remove the checkpoint an export reads: the newest is read again, this often.
PRUNED_RETRIES = 3


def export_checkpoint(source: str | Path, output: str | Path, **options) -> Path:
    """The checkpoint as a HF model dir (see `export_found_checkpoint`). A
    run dir means its newest complete checkpoint, which a live run may prune
    while it is read: then the new newest is read, and nothing is blamed on the
    files that vanished."""
    check_not_inside(Path(output), Path(source))
    check_output_dir(Path(output), options.get("overwrite", False))  # before the (possibly long) merge
    for attempt in range(PRUNED_RETRIES + 1):
        backend, weights = find_model_weights(source)
        try:
            return export_found_checkpoint(source, backend, weights, output, **options)
        except (UsageError, OSError):
            if weights.parent.exists():
                raise
            if attempt == PRUNED_RETRIES or not (Path(source) / "checkpoints").is_dir():
                raise UsageError(f"{weights.parent} was removed while it was read (a live run with --keep_last "
                                 f"prunes its older checkpoints); export again, or pass a checkpoint the run "
                                 "keeps") from None
    raise AssertionError("unreachable")


def export_found_checkpoint(source: str | Path, backend: Backend, weights: Path, output: str | Path,
                            dtype: str = "float32", overwrite: bool = False, model: str | None = None,
                            max_shard_size: int = 2 * 10**9, adapter_only: bool = False,
                            trust_remote_code: bool = False, allow_unverified: bool = False) -> Path:
    """The checkpoint as a HF model dir, as the PEFT method that wrote
    it saves its model (adapters merged into their base), or (adapter_only)
    the adapters alone. `trust_remote_code` is the command line's: the run's
    own record of it is never taken."""
    from finetune.peft import peft_of_checkpoint

    output = Path(output)
    checkpoint_dir = weights.parent
    # What the export reads, against the checksums the checkpoint recorded.
    verify_manifest(checkpoint_dir, under=(weights.name, MODEL_CONFIG_DIR), allow_unverified=allow_unverified)
    model_files = checkpoint_dir / MODEL_CONFIG_DIR
    peft = peft_of_checkpoint(model_files)
    if adapter_only and not peft.saves_adapters:
        raise UsageError(f"{checkpoint_dir} is a full fine-tune's checkpoint: it holds the whole model and no "
                         "adapters; export it without --adapter_only")
    # --model: the base to merge the adapters into, else where the config comes from
    base_model, model = (model, None) if peft.saves_adapters else (None, model)
    config_source = model or (str(model_files) if model_files.is_dir() else None)
    if config_source is None:
        raise UsageError(f"{checkpoint_dir} has no {MODEL_CONFIG_DIR}/ (not written by finetune); pass --model with "
                         "the HF model dir or id it was trained from, for its config and tokenizer")
    try:
        config = AutoConfig.from_pretrained(config_source, trust_remote_code=False)
        task = task_for_config(config)
        tokenizer = preprocessing(task, config_source)
    except (OSError, ValueError) as e:
        raise UsageError(f"could not read the model config/tokenizer from {config_source} "
                         f"({str(e).strip().splitlines()[0]}); pass --model with a HF model dir") from None
    generation_config = read_generation_config(config_source)
    if adapter_only:
        written = peft.export_adapter(checkpoint_dir, backend.export_weights(weights), output)
        write_model_card(written, config, checkpoint_record(checkpoint_dir))
        return written
    task = run_task(checkpoint_dir, base_model, trust_remote_code) if peft.needs_base(model_files) else None
    model_weights = peft.export_weights(checkpoint_dir, backend.export_weights(weights),
                                          lambda: task.base_model(tokenizer), task and task.model_source)
    tied = read_tied(model_files) if config_source == str(model_files) and not peft.saves_adapters else None
    try:
        written = write_model_dir(model_weights, config, output, tokenizer=tokenizer,
                                  generation_config=generation_config, run_data=run_data(checkpoint_dir), dtype=dtype,
                                  max_shard_size=max_shard_size, overwrite=overwrite, tied=tied)
        write_model_card(written, config, checkpoint_record(checkpoint_dir))
        return written
    except (OSError, SafetensorError) as e:  # a full disk, a read-only dir; the temporary dir is already gone
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
        raise UsageError(f"could not write {output} ({reason}); it was left as it was: "
                         f"{write_failure_fix(reason, Path(output).parent)}, or choose another --output") from None


def preprocessing(task, source: str):
    """What a model dir of `task` holds beside its weights: the processor
    (a vision-language model's, where one was saved), the tokenizer, or nothing."""
    if task is None or not task.has_tokenizer:
        return None
    if task.has_processor and (Path(source) / "processor_config.json").is_file():
        from transformers import AutoProcessor  # here: importing it loads transformers' model code (1 s)

        return AutoProcessor.from_pretrained(source, trust_remote_code=False)
    return AutoTokenizer.from_pretrained(source, trust_remote_code=False)


def run_task(checkpoint_dir: Path, base_model: str | None, trust_remote_code: bool):
    """The task of the run that wrote a checkpoint, which builds its base (or --model's)."""
    from finetune.objectives import build_task

    overrides = {"model": base_model} if base_model else {}
    cfg = load_config(checkpoint_dir / "run_config.yaml",
                      {**overrides, **({"trust_remote_code": True} if trust_remote_code else {})})
    task = build_task(cfg)
    if is_gguf(cfg.model):
        task.model_source = str(converted_dir(cfg.model))
    return task


def is_model_dir(path: Path) -> bool:
    """A HF model dir (an export, a run's final/): its config at the top, unlike a checkpoint or a run dir."""
    return (path / "config.json").is_file() and not (path / "checkpoints").is_dir()


def check_output_file(output: Path, overwrite: bool) -> None:
    if output.suffix != ".gguf":
        raise UsageError(f"--output {output}: a GGUF export writes one file; name it NAME.gguf")
    if output.is_dir():
        raise UsageError(f"--output {output} is a directory; name the .gguf file to write")
    if output.exists() and not overwrite:
        raise UsageError(f"--output {output} exists; pass --overwrite or choose another --output")
    if problem := why_it_cannot_be_made(output.absolute().parent):
        raise UsageError(f"cannot write {output}: it is not in a writable directory ({problem}); choose another --output")


def export_gguf(source: str | Path, output: str | Path, gguf_type: str = "f16", overwrite: bool = False,
                progress=lambda line: None, **checkpoint_options) -> Path:
    """A model dir, a checkpoint or a run (its newest checkpoint; LoRA merged)
    as one GGUF file. A checkpoint goes through a float32 model dir beside the
    output first (the export above), removed once the file is written."""
    from finetune.gguf_export import family_of, write_gguf

    source, output = Path(source), Path(output)
    check_output_file(output, overwrite)
    if is_model_dir(source):
        return written_gguf(lambda: write_gguf(source, output, gguf_type, progress=progress), output)
    check_not_inside(output, source)
    _, weights = find_model_weights(source)
    if (config_dir := weights.parent / MODEL_CONFIG_DIR).is_dir():  # refused before the (possibly long) merge
        family_of(AutoConfig.from_pretrained(config_dir, trust_remote_code=False))
    staging = output.absolute().parent / f".{output.name}.hf-tmp-{os.getpid()}"
    try:
        progress(f"merging {source} into a model dir first ({staging})")
        export_checkpoint(source, staging, **checkpoint_options)
        name = (source if (source / "checkpoints").is_dir() else source.parent.parent).name
        return written_gguf(lambda: write_gguf(staging, output, gguf_type, name=name, progress=progress), output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def written_gguf(write, output: Path) -> Path:
    try:
        return write()
    except OSError as e:  # a full disk, a read-only dir; the temporary file is already gone
        reason = e.strerror or str(e).strip().splitlines()[0]
        raise UsageError(f"could not write {output} ({reason}); nothing was left in its place: "
                         f"{write_failure_fix(reason, output.parent)}, or choose another --output") from None
