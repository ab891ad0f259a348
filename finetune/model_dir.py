"""Writing a Hugging Face model dir: safetensors only, split into shards with
an index when large, tied weights stored once, the HF config, a generation
config for generative models and the tokenizer for text models; written to a
temporary dir and renamed into place when complete.

The end of training (`RUN_DIR/final`), every checkpoint's `model_config/` and
`finetune export` all write through this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from finetune.errors import UsageError, why_it_cannot_be_made
from finetune.lock import process_alive
from finetune.tasks import task_for_config

MODEL_CONFIG_DIR = "model_config"  # in every checkpoint: what an export needs besides the weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """The architecture a config describes, without memory (works for any size)."""
    task = task_for_config(config)
    if task is None:
        raise UsageError(f"{type(config).__name__} is neither a causal LM nor an image classifier this tool trains; "
                         "pass a model of one of its tasks")
    with torch.device("meta"):
        return task.auto().from_config(config)


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
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"output {out_dir} is a file, not a directory; choose another --output")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise UsageError(f"output dir {out_dir} exists and is not empty; pass --overwrite or choose another --output")
    if problem := why_it_cannot_be_made(out_dir.absolute().parent):
        raise UsageError(f"cannot write to {out_dir}: it is not in a writable directory ({problem}); choose another --output")


def remove_dead_temporaries(out_dir: Path) -> None:
    """Temporary dirs that writers of this output left when they were killed
    (`.NAME.tmp-PID`, the process gone)."""
    for tmp in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and tmp.is_dir() and not tmp.is_symlink() and not process_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def write_model_files(target: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase | None = None,
                      generation_config: GenerationConfig | None = None) -> None:
    """Everything of a model dir but its weights: config, generation config
    (generative models only), tokenizer (text models only)."""
    config.save_pretrained(target)
    task = task_for_config(config)
    if task is not None and task.generative:
        (generation_config or GenerationConfig.from_model_config(config)).save_pretrained(target)
    if tokenizer is not None:
        tokenizer.save_pretrained(target)


# In a checkpoint's model_config/: which parameters the model ties, so that an
# export knows which to store once without importing the model's code (1.1 s).
TIED_FILE = "tied_parameters.json"


def read_tied(model_files: Path) -> dict[str, str] | None:
    """A checkpoint's TIED_FILE; None when it has none (or not a name -> name map)."""
    try:
        tied = json.loads((model_files / TIED_FILE).read_text())
    except (OSError, ValueError):
        return None
    valid = isinstance(tied, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items())
    return tied if valid else None


# The data options of the run that trained the model (config.DATA_OPTIONS), next to its weights.
RUN_DATA_FILE = "finetune_run.json"


def read_json_object(path: Path) -> dict:
    """A JSON object from a file this tool wrote beside a model or a run ({} when missing or not one)."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def read_run_data(model_dir: str | Path) -> dict:
    """The data options recorded with a model ({} for a model from elsewhere)."""
    return read_json_object(Path(model_dir) / RUN_DATA_FILE)


def read_generation_config(source: str | Path) -> GenerationConfig | None:
    """A model's generation config, None where it has none (an image classifier, a model from elsewhere)."""
    try:
        return GenerationConfig.from_pretrained(source)
    except OSError:
        return None


@dataclass
class Weights:
    """A model's tensors by name, in order, fetched a few at a time: from a
    state dict in memory, or (export.py) straight from a checkpoint's shards,
    so that writing never holds more than one output file's tensors."""
    specs: dict[str, tuple[torch.Size, torch.dtype]]           # name -> shape and stored dtype
    fetch: Callable[[list[str]], dict[str, torch.Tensor]]

    @classmethod
    def in_memory(cls, state_dict: dict[str, torch.Tensor]) -> "Weights":
        return cls({name: (t.shape, t.dtype) for name, t in state_dict.items()},
                   lambda names: {name: state_dict[name].detach().to("cpu") for name in names})


def plan_files(sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    """Names grouped, in order, into files of at most max_shard_size bytes
    (a larger tensor gets a file of its own), as huggingface_hub splits them."""
    files, current, current_size = [], [], 0
    for name, size in sizes.items():
        if current and current_size + size > max_shard_size:
            files.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    return [*files, current] if current else files


@contextmanager
def atomic_dir(out_dir: Path):
    """A temporary dir next to out_dir, renamed to it (replacing it) when the
    block completes and removed when it fails: out_dir is never half written."""
    remove_dead_temporaries(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise UsageError(f"cannot write to {out_dir} ({e.strerror}); choose another --output") from None
    try:
        yield tmp
        mode = default_file_mode()
        for file in tmp.rglob("*"):  # safetensors writes its files readable by their owner alone
            if is_own_file(file):
                os.chmod(file, mode)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_file(path: Path, data: str | bytes) -> None:
    """`path` written whole as a new file, then renamed over what stood there:
    never written through a link standing at that name, never half written."""
    fd, scratch = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(scratch, default_file_mode())
        os.replace(scratch, path)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise


def is_own_file(path: Path) -> bool:
    """A regular file, not a link that may lead anywhere."""
    return path.is_file() and not path.is_symlink()


def default_file_mode() -> int:
    """What open() gives a new file here: 0o666 less the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_model_dir(weights: dict[str, torch.Tensor] | Weights, config: PretrainedConfig, out_dir: str | Path, *,
                    tokenizer: PreTrainedTokenizerBase | None = None,
                    generation_config: GenerationConfig | None = None, run_data: dict | None = None,
                    dtype: str = "float32", max_shard_size: int = 2 * 10**9, overwrite: bool = False,
                    tied: dict[str, str] | None = None) -> Path:
    """`tied`: each tied parameter's name -> the name it shares storage with, as
    a checkpoint recorded it (TIED_FILE); without it, the model code says."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    weights = weights if isinstance(weights, Weights) else Weights.in_memory(weights)
    torch_dtype = DTYPES[dtype]

    def stored_dtype(name: str) -> torch.dtype:
        return torch_dtype if weights.specs[name][1].is_floating_point else weights.specs[name][1]

    duplicates = tied if tied is not None else tied_duplicates(meta_model(config))
    # A tied tensor is stored once, under the name the model ties it to.
    names = [n for n in weights.specs if not (n in duplicates and duplicates[n] in weights.specs)]
    sizes = {n: weights.specs[n][0].numel() * stored_dtype(n).itemsize for n in names}
    files = plan_files(sizes, max_shard_size)
    filenames = ([f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
                 if len(files) > 1 else ["model.safetensors"])

    with atomic_dir(out_dir) as tmp:
        for filename, group in zip(filenames, files):
            tensors = {name: tensor.to(stored_dtype(name)).contiguous()  # no copy when it already is
                       for name, tensor in weights.fetch(group).items()}
            save_file(tensors, str(tmp / filename), metadata={"format": "pt"})
            del tensors  # before the next file's are fetched
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {name: filename for filename, group in zip(filenames, files) for name in group}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        config = config.__class__.from_dict(config.to_dict())
        config.dtype = dtype
        write_model_files(tmp, config, tokenizer, generation_config)
        if run_data:
            (tmp / RUN_DATA_FILE).write_text(json.dumps(run_data, indent=2))
    return out_dir


# --- which weights a model came from ---------------------------------------------------------------

SAMPLE_BYTES = 1 << 20     # read this much at each sampled offset of a large file
SAMPLES_PER_FILE = 16
WHOLE_FILE_BYTES = 64 << 20  # hash files up to this size completely


def _file_digest(path: Path, digest) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        if size <= WHOLE_FILE_BYTES:
            digest.update(f.read())
            return
        for i in range(SAMPLES_PER_FILE):  # the header (shapes, dtypes) first, then evenly spaced samples to the end
            f.seek((size - SAMPLE_BYTES) * i // (SAMPLES_PER_FILE - 1))
            digest.update(f.read(SAMPLE_BYTES))


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def weights_files_fingerprint(path: Path) -> str:
    """A local model dir's weight files and config, or one weights file."""
    digest = hashlib.sha256()
    if path.is_file():
        _file_digest(path, digest)
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == "config.json"))
        for file in files:
            _file_digest(file, digest)
    return digest.hexdigest()[:32]


def weights_fingerprint(source: str, model: torch.nn.Module) -> str:
    """A cheap fingerprint of the weights a model came from (an adapted run's
    base, a preference run's reference): of its files for a local dir or file
    (small files whole, large ones by their header and 16 samples of 1 MiB), of
    the Hub commit for a Hub id, and of the weights themselves for a preset
    built from a seed (small by definition)."""
    path = Path(source)
    if path.exists():
        return weights_files_fingerprint(path)
    digest = hashlib.sha256()
    if commit := getattr(model.config, "_commit_hash", None):
        digest.update(f"hub:{source}@{commit}".encode())
    else:
        for name, tensor in model.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]
