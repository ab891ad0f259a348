"""Reading a checkpoint that someone else may have written, or that a disk
damaged: nothing in it runs code, and nothing damaged loads silently.

- DCP's `.metadata` is a pickle: it is read here through an unpickler that
  knows only DCP's metadata classes, torch dtypes and sizes, and paths.
- Every non-tensor item DCP stores (optimizer hyperparameters, ...) and the
  scheduler and RNG files are unpickled with `weights_only=True` first; what
  fails is refused. Accelerate and DCP read them afterwards, already checked.
- A backend whose engine loads its own torch.save files unchecked checks
  them here first, with its allow-list (finetune/backends).
- Every checkpoint ends with `manifest.json`, the size and SHA-256 of every
  file in it (finetune/manifest.py); resume and export check the files they
  read against it first.

Each refusal is a UsageError: one line naming the file and what to do.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from accelerate.utils import load as accelerate_load
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from finetune.errors import UsageError
from finetune.manifest import check_present

DCP_METADATA = ".metadata"

# What DCP (torch 2.6 - 2.13) puts into .metadata, and nothing that can run code.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout by name, e.g. "torch.strided"
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _Refused(pickle.UnpicklingError):
    """A class or function the allow-list does not name."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def read_dcp_metadata(shard_dir: Path) -> Metadata:
    path = shard_dir / DCP_METADATA
    if not path.is_file():
        raise UsageError(f"{shard_dir} has no readable DCP metadata ({DCP_METADATA}); the checkpoint is incomplete, "
                         "resume from an earlier one")
    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise UsageError(f"{path} holds {e}, which DCP metadata never does, so it was not loaded; use a checkpoint "
                         "from a source you trust") from None
    except Exception as e:  # truncated or garbage bytes
        raise UsageError(f"{path} is not readable DCP metadata ({type(e).__name__}); the checkpoint is damaged, "
                         "resume from an earlier one") from None
    if not isinstance(metadata, Metadata):
        raise UsageError(f"{path} is not DCP metadata; the checkpoint is damaged, resume from an earlier one")
    return metadata


def check_dcp_dir(shard_dir: Path) -> Metadata:
    """The metadata, every file it names present and long enough, and every
    non-tensor item loadable with weights_only."""
    metadata = read_dcp_metadata(shard_dir)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        check_present(shard_dir / name, size)
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        path = shard_dir / info.relative_path
        if getattr(info, "transform_descriptors", None):
            raise UsageError(f"{path} stores {index.fqn} through DCP storage transforms, which this tool cannot "
                             "check before loading; re-save the checkpoint without them")
        with path.open("rb") as f:
            f.seek(info.offset)
            _load_weights_only(io.BytesIO(f.read(info.length)), f"{path} (item {index.fqn})")
    return metadata


def check_pickled_file(path: Path, allowed: tuple = ()) -> None:
    """A torch.save file (scheduler, RNG states) loads with weights_only."""
    if not path.is_file():
        raise UsageError(f"{path} is missing; the checkpoint is incomplete, resume from an earlier one")
    with path.open("rb") as f, torch.serialization.safe_globals(list(allowed)):
        _load_weights_only(f, str(path))


def _load_weights_only(f, where: str) -> None:
    """Accelerate's torch.load: weights_only, with the numpy RNG types it saves allowed."""
    try:
        accelerate_load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "global" not in str(e).lower():  # no refused class or function named: bytes that are no pickle
            raise UsageError(f"{where} is not readable (not a torch.save file); the checkpoint is damaged, resume "
                             "from an earlier one") from None
        raise UsageError(f"{where} holds more than tensors and plain values, so it was not loaded; use a "
                         "checkpoint from a source you trust") from None
    except Exception as e:
        raise UsageError(f"{where} is not readable ({type(e).__name__}); the checkpoint is damaged, resume from an "
                         "earlier one") from None
