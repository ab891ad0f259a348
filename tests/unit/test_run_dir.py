"""What an --output_dir may hold before a run (finetune/run_dir.py): another
run is refused, a failed start is not in the way."""

from __future__ import annotations

import pytest

from finetune.config import TrainConfig
from finetune.errors import UsageError
from finetune.lock import LOCK_FILE, remove_new_run_dir
from finetune.run_dir import check_run_dir, failed_start, starts_afresh


def _config(run_dir, **kw) -> TrainConfig:
    return TrainConfig(model="tiny-gpt2", output_dir=str(run_dir), **kw)


def test_a_run_that_failed_before_its_first_checkpoint_is_not_in_the_way(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002.tmp").mkdir(parents=True)  # a first save cut short
    (run / "run_config.yaml").write_text("max_steps: 4\n")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    assert failed_start(run) and starts_afresh(run)
    check_run_dir(_config(run))
    for kept in ("summary.json", "final", "checkpoints/step_000002"):
        done = tmp_path / kept.replace("/", "_")
        (done / "checkpoints").mkdir(parents=True)
        (done / "run_config.yaml").write_text("max_steps: 4\n")
        (done / kept).mkdir(exist_ok=True) if "." not in kept else (done / kept).write_text("{}")
        assert not failed_start(done) and not starts_afresh(done)
        with pytest.raises(UsageError, match="already holds a run"):
            check_run_dir(_config(done))


def test_what_a_failed_start_wrote_is_removed_and_a_dir_that_was_there_stays(tmp_path):
    run = tmp_path / "made" / "run"
    run.mkdir(parents=True)
    (run / "run_config.yaml").write_text("x")
    (run / "tb").mkdir()
    remove_new_run_dir(run, [tmp_path / "made"])
    assert not (tmp_path / "made").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "metrics.jsonl").write_text("x")
    remove_new_run_dir(kept, [], keep_dir=True)
    assert kept.is_dir() and not any(kept.iterdir())
    (kept / LOCK_FILE).write_text('{"pid": 1}')  # another run holds it: nothing is touched
    (kept / "run_config.yaml").write_text("x")
    remove_new_run_dir(kept, [])
    assert (kept / "run_config.yaml").is_file()
    assert starts_afresh(tmp_path / "user_files")  # not there yet
    (tmp_path / "user_files").mkdir()
    (tmp_path / "user_files" / "notes.txt").write_text("mine")
    assert not starts_afresh(tmp_path / "user_files")  # a dir of the user's own: never emptied
