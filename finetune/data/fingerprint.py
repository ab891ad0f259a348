"""What a run read, by content: the local data and chat-template files its
options name, its reward files and reward models. Recorded in every
checkpoint's run_config.yaml (under `inputs:`, a record, not an option) and
compared when the run resumes: the data and the template are fixed by the
checkpoint, so a file replaced under the same name is refused like a changed
option."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from finetune.data.locations import glob_matches
from finetune.errors import UsageError

# The options that name files the run reads; their values are recorded as absolute paths.
INPUT_OPTIONS = ("dataset", "chat_template")


def reward_file(spec: str) -> Path | None:
    """The file a --reward_funcs FILE.py:NAME is read from (None for a module, a built-in or a model dir)."""
    where = spec.rpartition(":")[0]
    return Path(where) if where.endswith(".py") else None


def local_path(value: str) -> Path | None:
    """The file or dir an option names, when it names one on this machine."""
    return Path(value) if value and Path(value).exists() else None


# A streamed file is fingerprinted by its size, its first and last bytes and
# its modification time (an edit between the ends shows in that alone): reading
# the whole of a corpus larger than memory would delay every start.
STREAMED_BYTES_READ = 1 << 20


def fingerprint(path: Path, streamed: bool = False) -> dict[str, Any]:
    """Size, newest mtime and SHA-256 of a file, or of every file under a dir
    (names included). The hash decides; size and mtime say what changed."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not
                                                 any(part.startswith(".") for part in p.relative_to(path).parts))
    digest, size, mtime = hashlib.sha256(), 0, 0.0
    times_ns = {}  # of the files read by their ends alone
    for file in files:
        stat = file.stat()
        size, mtime = size + stat.st_size, max(mtime, stat.st_mtime)
        if file != path:
            digest.update(f"{file.relative_to(path)}\0{stat.st_size}\0".encode())
        with file.open("rb") as f:
            if streamed and stat.st_size > 2 * STREAMED_BYTES_READ:
                digest.update(f.read(STREAMED_BYTES_READ))
                f.seek(-STREAMED_BYTES_READ, os.SEEK_END)
                digest.update(f.read())
                times_ns[str(file)] = stat.st_mtime_ns
                continue
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return with_times({"path": str(path), "files": len(files), "bytes": size, "mtime": mtime,
                       "sha256": digest.hexdigest()}, times_ns)


def with_times(found: dict[str, Any], times_ns: dict[str, int]) -> dict[str, Any]:
    """`sha256` covers the files' times too; `content_sha256` what was read of them."""
    if not times_ns:
        return found
    times = json.dumps(times_ns, sort_keys=True)
    return {**found, "content_sha256": found["sha256"], "times_ns": times_ns,
            "sha256": hashlib.sha256(f"{found['sha256']}\0{times}".encode()).hexdigest()}


def input_fingerprints(cfg, reference: str | None = None) -> dict[str, dict]:
    """The fingerprint of every local file or dir the run's options name (a
    mixture's: of its local sources together), and of the frozen `reference`
    model a preference run compares with (Task.frozen_reference)."""
    found = {}
    if reference:
        found["reference"] = reference_fingerprint(reference)
    for name in INPUT_OPTIONS:
        value = getattr(cfg, name)
        paths = [path for v in (value if isinstance(value, list) else [value])
                 for path in ([local_path(v)] if local_path(v) else glob_matches(v))]
        prints = [fingerprint(path, streamed=getattr(cfg, "streaming", False)) for path in paths]
        if len(prints) == 1 and local_path(value if isinstance(value, str) else ""):
            found[name] = prints[0]
        elif prints:
            found[name] = with_times(
                {"path": [p["path"] for p in prints], "files": sum(p["files"] for p in prints),
                 "bytes": sum(p["bytes"] for p in prints), "mtime": max(p["mtime"] for p in prints),
                 "sha256": hashlib.sha256("".join(p.get("content_sha256", p["sha256"]) for p in prints).encode()
                                          ).hexdigest()},
                {file: ns for p in prints for file, ns in p.get("times_ns", {}).items()})
    rewards = {spec: reward_fingerprint(spec) for spec in getattr(cfg, "reward_funcs", [])}
    rewards = {spec: digest for spec, digest in rewards.items() if digest}
    if rewards:  # the user's reward files by content, reward models' dirs by their weights
        found["reward_funcs"] = rewards
    return found


def reward_fingerprint(spec: str) -> str | None:
    """A reward file's SHA-256, a reward model dir's weights' (as a reference's),
    or None for a module or a built-in."""
    path = reward_file(spec)
    if path is not None:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    if Path(spec).is_dir():
        from finetune.model_dir import weights_files_fingerprint

        return "weights:" + weights_files_fingerprint(Path(spec))
    return None


def reference_fingerprint(source: str) -> dict[str, Any]:
    """A frozen reference's weights: a local model dir or file by its weight
    files' samples (as an adapted run's base), a Hub id or a preset (built from
    a seed) by its name."""
    from finetune.model_dir import weights_files_fingerprint

    path = Path(source)
    return {"path": source, "sha256": weights_files_fingerprint(path) if path.exists() else f"named:{source}"}


def check_same_inputs(recorded: Any, now: dict[str, dict], cfg, checkpoint_dir: Path) -> None:
    """A resume reads what its checkpoint was trained on (`now`: the inputs'
    fingerprints today), or stops in one line."""
    if not isinstance(recorded, dict):
        return  # a checkpoint from before inputs were recorded
    before, after = recorded.get("reference"), now.get("reference")
    if isinstance(before, dict) and before.get("sha256") != (after or {}).get("sha256"):
        named = "--reference_model" if cfg.reference_model else "--model"
        raise UsageError(f"{named} {getattr(cfg, named[2:])} is not the reference {checkpoint_dir} was trained against "
                         f"({before.get('path')}, as it was then); a resume compares with the same reference: pass "
                         "it as it was, or start a new run in another --output_dir")
    rewards_now = now.get("reward_funcs") or {}
    for spec, digest in (recorded.get("reward_funcs") or {}).items():
        if rewards_now.get(spec) != digest:
            what = f"the reward file {reward_file(spec)}" if reward_file(spec) else f"the reward model {spec}"
            raise UsageError(f"{what} changed since {checkpoint_dir} was written (or is gone); a resume scores with "
                             "the rewards its checkpoint was trained with: put the original back, or start a new run "
                             "in another --output_dir")
    for name in INPUT_OPTIONS:
        before, after = recorded.get(name), now.get(name)
        if not isinstance(before, dict) or before.get("sha256") == (after or {}).get("sha256"):
            continue
        if "times_ns" not in before and before.get("sha256") == (after or {}).get("content_sha256"):
            continue  # recorded before streamed files' times were
        if after is None:
            raise UsageError(f"--{name} {getattr(cfg, name)} is gone; {checkpoint_dir} was trained on it: put it "
                             "back to resume, or start a new run in another --output_dir")
        retimed = {file: ns for file, ns in (before.get("times_ns") or {}).items()
                   if (after.get("times_ns") or {}).get(file) != ns}
        if retimed and before.get("content_sha256") == after.get("content_sha256"):
            file, ns = next(iter(retimed.items()))
            raise UsageError(f"--{name} {file} was modified since {checkpoint_dir} was written (same size and ends, "
                             "another time): a streamed file is checked by its size, its first and last MiB and its "
                             "time, as reading all of it would delay every start; if only its time changed (a copy), "
                             f"set it back with `touch -d @{ns // 10**9}.{ns % 10**9:09d} {file}`, else put the "
                             "original back or start a new run in another --output_dir")
        what = (f"{before.get('bytes')} -> {after['bytes']} bytes" if before.get("bytes") != after["bytes"]
                else "the same size, other content")
        raise UsageError(f"--{name} {getattr(cfg, name)} changed since {checkpoint_dir} was written ({what}); a resume "
                         "reads what its checkpoint was trained on: put the original back, or start a new run in "
                         "another --output_dir")


def absolute(value: str) -> str:
    """An option's local path made absolute, so that a resume from another dir reads the same file."""
    path = local_path(value)
    return str(Path(os.path.abspath(path))) if path is not None else value
