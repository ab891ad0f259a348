"""W&B (offline) and MLflow (a local file store) through Accelerate's
trackers: one tracker run per training run, opened on the main process only,
with the same values as metrics.jsonl under grouped names, continued by a
resume."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from conftest import check_ok, common_args, run_cli, train_rows

pytestmark = pytest.mark.slow


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline W&B run file: LevelDB-log framed records
    (7-byte header: checksum, length, type; 32 KiB blocks) of wandb's Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, rows = run_file.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_and_mlflow_hold_one_run_each_with_the_jsonl_values(tmp_path, env, small_corpus, monkeypatch):
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    tracking = f"file://{tmp_path / 'mlruns'}"
    env = {**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": tracking,
           "MLFLOW_ALLOW_FILE_STORE": "true"}
    run_dir = tmp_path / "run"
    check_ok(run_cli(["train", *common_args(small_corpus), "--max_steps", "4", "--checkpoint_every", "2",
                      "--report_to", "jsonl,wandb,mlflow", "--output_dir", str(run_dir)], env, mixed_precision="no", warm=True))
    check_ok(run_cli(["resume", str(run_dir), "--max_steps", "6"], env, mixed_precision="no", warm=True))
    losses = {r["step"]: r["loss"] for r in train_rows(run_dir)}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]

    ids = json.loads((run_dir / "tracker_runs.json").read_text())
    offline_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert offline_runs and {p.name.rsplit("-", 1)[1] for p in offline_runs} == {ids["wandb"]}  # resumed, same run
    history = [row for p in offline_runs for row in wandb_history(next(p.glob("run-*.wandb")))]
    assert {row["_step"]: row["train/loss"] for row in history if "train/loss" in row} == pytest.approx(losses)
    assert any("eval/perplexity" in row for row in history)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.tracking.MlflowClient(tracking)
    runs = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    assert [(r.info.run_id, r.info.run_name) for r in runs] == [(ids["mlflow"], "run")]
    logged = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "train/loss")}
    assert logged == pytest.approx(losses)
