"""A checkpoint's manifest: the size and SHA-256 of every file it holds,
written after every rank has saved and checked before anything is read. It
needs no library: `finetune resume` checks it before it imports any."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from finetune.errors import UsageError

MANIFEST = "manifest.json"


def check_present(path: Path, size: int) -> None:
    """The file exists and holds at least `size` bytes."""
    if not path.is_file():
        raise UsageError(f"{path} is missing; the checkpoint is incomplete, resume from an earlier one")
    if path.stat().st_size < size:
        raise UsageError(f"{path} is truncated ({path.stat().st_size} of {size} bytes); the checkpoint is damaged, "
                         "resume from an earlier one")


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
