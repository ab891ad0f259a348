"""How a run ends early on purpose.

`UsageError` is bad user input: the CLI prints it as a single line (no
traceback) and exits with code 2. Its message must name the problem and the fix.

`RankLost` is a run ended because a rank stopped answering: one line from
the ranks that noticed, naming the silent ones, exit code 1.

`NotDistributed` is a run that asked for sharding (FSDP, ZeRO) or several
processes and did not get them (Accelerate fell back to DDP or left each rank
alone): one line, exit code 1, before any step trains unsharded.

`Stopped` is a run stopped by Ctrl-C or SIGTERM after saving a checkpoint: one
line saying where to resume, exit code 128 + the signal number, as shells report
a process ended by that signal.
"""

from __future__ import annotations

import os

from pathlib import Path


class UsageError(Exception):
    exit_code = 2


class Stopped(Exception):
    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class RankLost(Exception):
    exit_code = 1


class NotDistributed(Exception):
    exit_code = 1


def first_line(error: BaseException) -> str:
    """An exception's message, its first line, for a one-line error (its type's name when it has none)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def not_a_file(path: str | Path) -> str:
    """Why a path the user named as a file cannot be read as one."""
    return "is a directory, not a file" if Path(path).is_dir() else missing_or_odd(path)


def missing_or_odd(path: str | Path) -> str:
    """Why a path that is neither the file nor the dir wanted is not there: it
    may exist as something else (a dangling link, a FIFO, a socket)."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        return f"is a link to {os.readlink(path)}, which does not exist"
    if path.exists() and not path.is_file() and not path.is_dir():
        return "is not a regular file (a FIFO, socket or device)"
    return "is a file" if path.is_file() else "does not exist"


# What the OS says when a write fails, and what to do about it: the fix follows the cause.
WRITE_FIXES = (
    (("No space left", "Disk quota exceeded", "File too large"), "free space on that device"),
    (("Permission denied", "Read-only file system", "Operation not permitted"), "fix the permissions of {where}"),
    (("File exists", "Directory not empty", "Is a directory", "Not a directory"),
     "move aside what is already in the way under {where}"),
)


def write_failure_fix(reason: str, where: object, out_of_space: bool = False) -> str:
    """The fix for a failed write, from its reason (`out_of_space`: the disk was
    found nearly full, whatever the library said)."""
    if out_of_space:
        return WRITE_FIXES[0][1]
    for causes, fix in WRITE_FIXES:
        if any(cause.lower() in reason.lower() for cause in causes):
            return fix.format(where=where)
    return f"remove the cause named in parentheses (under {where})"


def why_it_cannot_be_made(path: Path) -> str | None:
    """Why `path` (a file or dir to write) cannot be made where it is named, or
    None: its nearest existing ancestor is a file, is read-only, or takes no new
    entries (/proc, /sys). Tried for real, with an empty dir made and removed,
    since the permission bits say nothing of the file system under them."""
    import errno
    import os
    import tempfile

    existing = next(p for p in [path, *path.absolute().parents] if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".finetune-probe-", dir=existing))
    except OSError as e:
        return f"{existing} is read-only" if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else \
            f"{existing} takes no new files: {e.strerror}"
    return None
