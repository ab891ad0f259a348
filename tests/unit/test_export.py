"""`finetune export` of a live run (finetune/export.py)."""

from __future__ import annotations

import shutil

import pytest

from finetune import export
from finetune.errors import UsageError


def _run_with_checkpoints(tmp_path, *steps: int):
    for step in steps:
        (tmp_path / "run" / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (tmp_path / "run" / "checkpoints" / f"step_{step:06d}" / "model.safetensors").write_bytes(b"")
    return tmp_path / "run"


def test_a_checkpoint_pruned_while_it_is_read_gives_way_to_the_newest(tmp_path, monkeypatch):
    """A live run with --keep_last 1 removes the checkpoint an export reads:
    the export reads the new newest, and blames nothing on the vanished files."""
    run = _run_with_checkpoints(tmp_path, 2, 4)
    read = []

    def pruned_while_read(source, backend, weights, output, **options):
        read.append(weights.parent.name)
        if len(read) == 1:  # the run saved step 6 and pruned step 4 as the export read it
            _run_with_checkpoints(tmp_path, 6)
            shutil.rmtree(weights.parent)
            raise UsageError("could not read the model config/tokenizer from ...")
        return output

    monkeypatch.setattr(export, "export_found_checkpoint", pruned_while_read)
    assert export.export_checkpoint(run, tmp_path / "out") == tmp_path / "out"
    assert read == ["step_000004", "step_000006"]

    def always_pruned(source, backend, weights, output, **options):
        shutil.rmtree(weights.parent)
        raise OSError("gone")

    _run_with_checkpoints(tmp_path, 8, 10, 12, 14, 16)
    monkeypatch.setattr(export, "export_found_checkpoint", always_pruned)
    with pytest.raises(UsageError, match="was removed while it was read .*--keep_last"):
        export.export_checkpoint(run, tmp_path / "out")
