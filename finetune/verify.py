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
  file in it, written after all ranks have finished; resume and export
  check the files they read against it.

Each refusal is a UsageError: one line naming the file and what to do.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from pathlib import Path

import torch
from accelerate.utils import load as accelerate_load
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from finetune.errors import UsageError

MANIFEST = "manifest.json"
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


def check_present(path: Path, size: int) -> None:
    """The file exists and holds at least `size` bytes."""
    if not path.is_file():
        raise UsageError(f"{path} is missing; the checkpoint is incomplete, resume from an earlier one")
    if path.stat().st_size < size:
        raise UsageError(f"{path} is truncated ({path.stat().st_size} of {size} bytes); the checkpoint is damaged, "
                         "resume from an earlier one")


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


# --- the manifest --------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(checkpoint_dir: Path) -> None:
    """Size and SHA-256 of every file in the checkpoint; call after every rank has written."""
    files = sorted(p for p in checkpoint_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(checkpoint_dir)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (checkpoint_dir / MANIFEST).write_text(json.dumps({"algorithm": "sha256", "files": entries}, indent=1))


def verify_manifest(checkpoint_dir: Path, under: tuple[str, ...] = ("",), allow_unverified: bool = False) -> bool:
    """Check the files listed under these sub-paths against the manifest. A
    checkpoint without one (written elsewhere, by an older finetune, or with
    the manifest deleted) is refused unless the command line allows it: False then."""
    path = checkpoint_dir / MANIFEST
    if not path.is_file():
        if allow_unverified:
            return False
        raise UsageError(f"{checkpoint_dir} has no {MANIFEST}, so its files cannot be checked for damage or "
                         "changes (it was written elsewhere, by an older finetune, or the manifest was deleted); "
                         "pass --allow_unverified_checkpoint to read it anyway, only if you trust where it came from")
    try:
        files = json.loads(path.read_text())["files"]
        listed = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UsageError(f"{path} is not a readable manifest; the checkpoint is damaged, resume from an earlier "
                         "one") from None
    for name, (size, digest) in sorted(listed.items()):
        if not name.startswith(under) or ".." in Path(name).parts:
            continue
        file = checkpoint_dir / name
        check_present(file, size)
        if file.stat().st_size != size or _sha256(file) != digest:
            raise UsageError(f"{file} does not match the checksum its checkpoint recorded: the file was changed or "
                             "damaged after saving; resume from an earlier checkpoint")
    return True
