"""Unit tests of errors and their fixes."""

from __future__ import annotations

import os


def test_a_failed_write_gets_the_fix_of_its_cause():
    """"Free space" only for a full disk: an existing file or dir in the way, or
    a permission, gets its own fix (the OS's own words, as the write reports them)."""
    import errno

    from finetune.errors import write_failure_fix

    where = "RUN/checkpoints"
    assert write_failure_fix(os.strerror(errno.ENOSPC), where) == "free space on that device"
    assert write_failure_fix("torch.save failed", where, out_of_space=True) == "free space on that device"
    for code in (errno.EACCES, errno.EROFS):
        assert write_failure_fix(f"[Errno {code}] {os.strerror(code)}: '{where}/x'", where) == \
            f"fix the permissions of {where}"
    for code in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
        fix = write_failure_fix(f"[Errno {code}] {os.strerror(code)}: '{where}/.tmp-step_000002'", where)
        assert fix == f"move aside what is already in the way under {where}", code
        assert "free space" not in fix
    assert "free space" not in write_failure_fix("CheckpointException: something else", where)


def test_a_path_that_is_there_as_something_else_is_never_said_not_to_exist(tmp_path):
    import os

    from finetune.errors import missing_or_odd, not_a_file

    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    os.mkfifo(tmp_path / "fifo")
    assert missing_or_odd(tmp_path / "notes.txt") == "is a file"
    assert missing_or_odd(tmp_path / "dangling") == f"is a link to {tmp_path / 'gone'}, which does not exist"
    assert missing_or_odd(tmp_path / "fifo") == "is not a regular file (a FIFO, socket or device)"
    assert missing_or_odd(tmp_path / "none") == "does not exist" and not_a_file(tmp_path) == "is a directory, not a file"
