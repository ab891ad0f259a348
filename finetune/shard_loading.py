"""Pretrained weights read straight into FSDP2 shards: every rank builds the
model without its weights, `prepare` shards it, and then each rank reads from
the safetensors files only the rows of each tensor it keeps. No process ever
holds the whole model, the main process included.

Used under `fsdp_cpu_ram_efficient_loading: true` when --model is a local dir
of safetensors files whose tensor names are the model's. Anything else (a Hub
id, .bin weights, names transformers converts on load, weights it has to
initialise, a preset built from a seed) goes through Accelerate's way of the
same flag: the main process loads the model and sends every rank its shards.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import PretrainedConfig

from finetune.safetensors_index import SAFETENSORS_INDEX, indexed_files
from finetune.model_dir import Weights, tied_duplicates
from finetune.parameters import base_model_name, canonical_name

SAFETENSORS_FILE = "model.safetensors"
# safetensors' names of the dtypes a model file holds.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def safetensors_weights(path: Path) -> Weights:
    """The tensors of one safetensors file, read a few at a time."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        specs = {name: (torch.Size(f.get_slice(name).get_shape()), SAFETENSORS_DTYPES[f.get_slice(name).get_dtype()])
                 for name in f.keys()}

    def read_file(names: list[str]) -> dict[str, torch.Tensor]:
        with safe_open(str(path), "pt") as f:
            return {name: f.get_tensor(name) for name in names}
    return Weights(specs, read_file)


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file (row-major, no gaps)."""
    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset of its first byte in the file

    def read_rows(self, first_row: int, out: torch.Tensor, load_dtype: torch.dtype | None = None) -> None:
        """Rows first_row.. of the tensor (as many as `out` has) into `out`,
        read straight from the file: no mapping of the file (its pages would
        count in this process's resident set) and, when the dtypes agree, no
        copy in between. `load_dtype` (default: out's) is the dtype the values
        pass through, as when bf16-loaded weights are held in fp32."""
        load_dtype = load_dtype or out.dtype
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        same = out.dtype == self.dtype == load_dtype and out.device.type == "cpu" and out.is_contiguous()
        buffer = out if same else torch.empty(out.shape, dtype=self.dtype)
        raw = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
        with open(self.file, "rb", buffering=0) as f:
            f.seek(self.start + first_row * row_bytes)
            done = 0
            while done < len(raw):
                got = f.readinto(raw[done:])
                if not got:
                    raise OSError(f"{self.file} ends inside {self.name}")
                done += got
        if not same:
            out.copy_(buffer.to(load_dtype))


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, from its JSON header (checked
    against the file's size: the file may come from someone else)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= min(size - 8, 100 * 2**20):
            raise ValueError(f"{file} is not a safetensors file")
        header = json.loads(f.read(length))
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize or 8 + length + end > size:
            raise ValueError(f"{file} is damaged: {name} does not fit its place in the file")
        tensors[name] = StoredTensor(file, name, dtype, shape, 8 + length + begin)
    return tensors


def stored_tensors(model_dir: Path) -> dict[str, StoredTensor] | None:
    """Every tensor of a dir written by save_pretrained in safetensors (one
    file, or shards with an index); None for other layouts."""
    if (model_dir / SAFETENSORS_INDEX).is_file():
        files = indexed_files(model_dir)
    elif (model_dir / SAFETENSORS_FILE).is_file():
        files = [model_dir / SAFETENSORS_FILE]
    else:
        return None
    return {name: tensor for file in files for name, tensor in read_header(file).items()}


def base_name(name: str) -> str:
    """A live parameter's name as the pretrained model's own: without the
    wrappers (canonical_name) and without the adapter wrapper's `base_model.model.` and `.base_layer`."""
    return base_model_name(canonical_name(name))


@dataclass
class OwnShards:
    """Where each of the model's tensors lies in the files."""
    sources: dict[str, StoredTensor]  # the model's name (tied ones under each name) -> its bytes
    load_dtype: torch.dtype            # --model_dtype: floating-point weights are rounded to it on the way

    @classmethod
    def for_model(cls, model_source: str, config: PretrainedConfig, auto_class, trust_remote_code: bool,
                  load_dtype: torch.dtype = torch.float32) -> "OwnShards | None":
        """None unless every parameter and persistent buffer of the model the
        config describes is in the files with its shape, under the name
        transformers would load it as: its checkpoint renamings (GPT-NeoX's
        `embed_out` is `lm_head`), the base model prefix added or removed
        (GPT-2's Hub files have no `transformer.`), or another name of a tied
        tensor. A weight transformers converts on load (fused experts, ...)
        means None."""
        path = Path(model_source)
        try:
            stored = stored_tensors(path) if path.is_dir() else None
        except (OSError, ValueError, KeyError, TypeError):
            return None  # from_pretrained will say what is wrong with the files
        if not stored:
            return None
        with torch.device("meta"):
            model = auto_class.from_config(config, trust_remote_code=trust_remote_code)
        by_model_name = _as_loaded(stored, model)
        if by_model_name is None:
            return None
        # A tied tensor is stored once, under any of its names: each name -> all of them.
        groups: dict[str, list[str]] = {}
        for duplicate, first in tied_duplicates(model).items():
            groups.setdefault(first, [first]).append(duplicate)
        aliases = {name: group for group in groups.values() for name in group}
        sources = {}
        for name, tensor in model.state_dict(keep_vars=True).items():  # parameters and persistent buffers
            found = next((by_model_name[a] for a in aliases.get(name, [name]) if a in by_model_name), None)
            if found is None or found.shape != tuple(tensor.shape):
                return None
            sources[name] = found
        return cls(sources, load_dtype)

    @torch.no_grad()
    def fill(self, model: torch.nn.Module, added: Callable[[str], bool] = lambda name: False) -> None:
        """Read into every parameter and persistent buffer of the sharded model
        the rows this rank keeps, cast as from_pretrained(dtype=--model_dtype)
        casts them, then to the tensor's dtype (fp32 under mixed precision).
        What the PEFT method `added` (adapters) is not in the files: it
        was initialised the same on every rank."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        for name, target in model.state_dict(keep_vars=True).items():  # the live (sharded) tensors themselves
            source = self.sources.get(base_name(name))
            if source is None:
                if added(name):
                    continue
                raise RuntimeError(f"{name} is not in the pretrained files")
            local, offset = target, (0,) * target.dim()
            if isinstance(target, DTensor):
                local = target.to_local()
                _, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
            if local.numel() == 0:
                continue
            if any(offset[1:]) or tuple(local.shape[1:]) != source.shape[1:]:  # FSDP2 shards rows only
                raise RuntimeError(f"{name} is sharded by columns ({target.placements}); only row shards are read")
            via = self.load_dtype if local.is_floating_point() and source.dtype.is_floating_point else None
            source.read_rows(offset[0] if offset else 0, local, via)


def _as_loaded(stored: dict[str, StoredTensor], model: torch.nn.Module) -> dict[str, StoredTensor] | None:
    """The stored tensors under the names from_pretrained gives them, by
    transformers' own renaming rules; None when one needs more than a rename."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    renamed = {}
    for key, tensor in stored.items():
        name, converted_by = rename_source_key(key, renamings, converters, model.base_model_prefix or None, meta_state)
        if converted_by is not None:
            return None
        renamed[name] = tensor
    return renamed

