"""The lectures' CNN through the same launch, checkpoint, resume and export path
as the LMs: real 2-process FSDP runs on the built-in handwritten digits."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForImageClassification

import finetune.models.cnn  # noqa: F401  (registers lecture-cnn with the transformers Auto classes)
from conftest import check_ok, dcp_elements_per_file, read_jsonl, run_cli, run_in_process

pytestmark = pytest.mark.slow

# The docs' command: the lectures' recipe is for MNIST's 60,000 images; on
# 1,437 digits its global batch of 512 makes 2 steps an epoch, so it takes smaller steps.
TRAIN_IMAGES = 1437
STEPS_PER_EPOCH = TRAIN_IMAGES // 16 // 2  # whole batches of 16, split over 2 ranks
MIN_NUM_PARAMS = 512  # fsdp_cnn.yaml


@pytest.fixture(scope="module")
def cnn_run(docs_workdir) -> Path:
    """The docs' CNN command: 3 epochs, fp32 (fsdp_cnn.yaml), a checkpoint
    after epoch 2 and at the end, metrics to jsonl and TensorBoard."""
    run_dir = docs_workdir / "outputs" / "digits"
    assert json.loads((run_dir / "summary.json").read_text())["model"] == "lecture-cnn"
    return run_dir


def epoch_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "epoch_loss" in r or "accuracy" in r]


def test_two_process_fsdp_learns_the_digits(cnn_run):
    summary = json.loads((cnn_run / "summary.json").read_text())
    assert summary["task"] == "image-classification"
    assert summary["first_eval"]["accuracy"] < 0.3  # it starts from scratch
    assert summary["last_eval"]["accuracy"] >= 0.95
    assert summary["last_eval"]["num_samples"] == 360  # every test image once, none twice
    losses = [r["epoch_loss"] for r in epoch_rows(cnn_run) if "epoch_loss" in r]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2]


def test_cnn_is_sharded_by_size_based_wrap(cnn_run):
    summary = json.loads((cnn_run / "summary.json").read_text())
    assert summary["distributed_type"] == "FSDP" and summary["world_size"] == 2 and summary["fsdp_version"] == 2
    total, local = summary["total_params"], summary["local_params_per_rank"]
    assert sum(local) == total and all(abs(n - total / 2) <= 0.02 * total for n in local), local

    # One unit per module holding more than min_num_params parameters, plus the root.
    model = AutoModelForImageClassification.from_pretrained(cnn_run / "final")
    big = [name for name, m in model.named_modules() if name and sum(p.numel() for p in m.parameters()) > MIN_NUM_PARAMS]
    assert summary["fsdp_units"] == len(big) + 1 and summary["fsdp_units"] > 2

    # The checkpoint after epoch 2 holds one shard file per rank, each with that rank's share.
    shards = dcp_elements_per_file(cnn_run / "checkpoints" / f"step_{2 * STEPS_PER_EPOCH:06d}" / "pytorch_model_fsdp_0",
                                   skip=set())
    assert shards == {"__0_0.distcp": local[0], "__1_0.distcp": local[1]}


def test_step_schedule_halves_the_lr_every_epoch(cnn_run):
    rows = [r for r in read_jsonl(cnn_run / "metrics.jsonl") if "lr" in r]
    assert len(rows) == 3 * STEPS_PER_EPOCH
    for r in rows:
        epoch = (r["step"] - 1) // STEPS_PER_EPOCH
        assert r["epoch"] == epoch
        assert math.isclose(r["lr"], 1e-2 * 0.5 ** epoch, rel_tol=1e-12), r


def test_resume_at_an_epoch_boundary_matches_the_uninterrupted_run(cnn_run, tmp_path, env):
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(cnn_run / "run_config.yaml", resumed)
    checkpoint = f"step_{2 * STEPS_PER_EPOCH:06d}"
    shutil.copytree(cnn_run / "checkpoints" / checkpoint, resumed / "checkpoints" / checkpoint)
    check_ok(run_cli(["resume", str(resumed)], env, config="fsdp_cnn.yaml", warm=True))

    def after_epoch_2(run_dir):
        return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > 2 * STEPS_PER_EPOCH]

    expected, got = after_epoch_2(cnn_run), after_epoch_2(resumed)
    assert [r["step"] for r in got] == [r["step"] for r in expected] and len(got) > STEPS_PER_EPOCH
    for want, have in zip(expected, got):
        for key in ("loss", "lr", "epoch_loss", "eval_loss", "accuracy"):
            if key in want:
                assert math.isclose(have[key], want[key], rel_tol=1e-5, abs_tol=1e-7), (key, want, have)


def test_export_then_evaluate_gives_the_training_accuracy(cnn_run, tmp_path):
    out = tmp_path / "exported"
    assert run_in_process("export", cnn_run, "--output", out).returncode == 0
    assert {p.name for p in out.iterdir()} == {"config.json", "finetune_run.json", "model.safetensors", "README.md",
                                               "finetune_card.json"} | ({"loss.png"} if (out / "loss.png").exists() else set())
    assert AutoConfig.from_pretrained(out).id2label[7] == "7"  # class names from the data set
    final = load_file(str(cnn_run / "final" / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert final.keys() == exported.keys() and all((final[k] == exported[k]).all() for k in final)

    proc = run_in_process("evaluate", out, "--dataset", "builtin", "--per_device_batch_size", "32")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    trained = json.loads((cnn_run / "summary.json").read_text())["last_eval"]
    assert result["num_samples"] == 360
    assert result["accuracy"] == trained["accuracy"]
    assert math.isclose(result["eval_loss"], trained["eval_loss"], rel_tol=1e-4)
    card = (cnn_run / "final" / "README.md").read_text()  # the run's own card: an image classifier's
    assert "pipeline_tag: image-classification" in card and f"accuracy of this model: {trained['accuracy']:.4f}" in card
    assert "token" not in card and "images (16 per process" in card


def test_tensorboard_gets_the_same_metrics_as_the_jsonl(cnn_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((cnn_run / "tensorboard").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    rows = read_jsonl(cnn_run / "metrics.jsonl")
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("epoch_loss", "train/epoch_loss"),
                     ("eval_loss", "eval/loss"), ("accuracy", "eval/accuracy")):
        expected = [(r["step"], r[key]) for r in rows if key in r]
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in logged] == [s for s, _ in expected] and expected, tag
        assert all(math.isclose(v, w, rel_tol=1e-6) for (_, v), (_, w) in zip(logged, expected)), tag
