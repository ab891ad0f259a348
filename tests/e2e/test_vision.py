"""Vision-language fine-tuning end to end: tiny LLaVA, Idefics3 and Gemma 3
models, trained sharded under 2-process FSDP2 (fsdp.yaml as shipped) on the
embedded drawn shapes; checked from outside with transformers alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from conftest import check_ok, eval_rows, launches, made_once, run_cli_together, run_in_process
from finetune.data.shapes import build_shapes
from vlm_models import FAMILIES, greedy_accuracy, save_vlm_model

STEPS = {"llava": 60, "idefics3": 16, "gemma3": 16}  # LLaVA long enough to learn colours; the others to move


@pytest.fixture(scope="module")
def vlms(tmp_path_factory, worker_id) -> Path:
    return made_once(tmp_path_factory, worker_id, "vlm-models",
                     lambda root: [save_vlm_model(root / family, family) for family in FAMILIES])


@pytest.fixture(scope="module")
@launches
def vision_runs(vlms, tmp_path_factory, env) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision-runs")
    runs = {family: root / family for family in FAMILIES}
    procs = run_cli_together([(["train", "--task", "image-text-to-text", "--model", vlms / family, "--output_dir",
                                runs[family], "--max_steps", STEPS[family], "--eval_every", STEPS[family],
                                "--per_device_batch_size", "8", "--learning_rate", "3e-3", "--block_size", "256",
                                "--log_format", "plain"], {}) for family in FAMILIES], env)
    for proc in procs:
        check_ok(proc)
    return runs


def _batch(processor, rows: list[dict], root: Path) -> dict:
    texts = [processor.apply_chat_template(row["messages"], tokenize=False) for row in rows]
    images = [[Image.open(root / name).convert("RGB") for name in row["images"]] for row in rows]
    return processor(text=texts, images=images, padding=True, add_special_tokens=False, return_tensors="pt")


def test_each_family_trains_sharded_and_exports_to_the_same_logits(vision_runs, tmp_path):
    """Every family's weights were split over the ranks, its held-out answer
    loss fell, and final/ and an export of the last checkpoint are the same
    model to transformers (its Auto class and processor)."""
    fresh = build_shapes(count=4, seed=1, cache=tmp_path)
    rows = [json.loads(line) for line in fresh.read_text().splitlines()]
    for family, run in vision_runs.items():
        summary = json.loads((run / "summary.json").read_text())
        assert summary["distributed_type"] == "FSDP" and len(summary["local_params_per_rank"]) == 2
        assert all(n < 0.6 * summary["total_params"] for n in summary["local_params_per_rank"]), family
        first, last = eval_rows(run)[0], eval_rows(run)[-1]
        assert last["eval_loss"] < first["eval_loss"] - 0.3, (family, first, last)
        exported = tmp_path / f"{family}-export"
        check_ok(run_in_process("export", run, "--output", exported))
        logits = []
        for model_dir in (run / "final", exported):
            processor = AutoProcessor.from_pretrained(model_dir)
            model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
            with torch.no_grad():
                logits.append(model(**_batch(processor, rows, fresh.parent)).logits)
        torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-6)


def test_answers_about_new_images_beat_the_base_model(vision_runs, vlms, tmp_path):
    """Drawings the run never saw, answered greedily by final/ and by the base
    model, read and run with transformers alone; and `finetune generate --image`."""
    fresh = build_shapes(count=40, seed=7, cache=tmp_path)
    rows = [json.loads(line) for line in fresh.read_text().splitlines()]
    base = greedy_accuracy(vlms / "llava", rows, fresh.parent)
    trained = greedy_accuracy(vision_runs["llava"] / "final", rows, fresh.parent)
    assert trained >= base + 0.2, (base, trained)
    colour = next(row for row in rows if row["messages"][0]["content"][1]["text"].startswith("What colour"))
    proc = run_in_process("generate", vision_runs["llava"] / "final", "--prompt", "What colour is the shape?",
                          "--image", fresh.parent / colour["images"][0])
    check_ok(proc)
    assert proc.stdout.strip() in ("red", "green", "blue", "yellow", "square", "circle", "triangle"), proc.stdout
