"""Vision-language fine-tuning end to end: tiny LLaVA, Idefics3 and Gemma 3
models, trained sharded under 2-process FSDP2 (fsdp.yaml as shipped) on the
embedded drawn shapes; checked from outside with transformers alone."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from conftest import (check_ok, eval_rows, launches, made_once, run_cli, run_cli_together, run_in_process,
                      stopped_by_sigterm, train_rows)
from finetune.data.shapes import build_shapes
from finetune.data.shapes import COLOURS
from vlm_models import FAMILIES, HAS_TORCHVISION, greedy_accuracy, needs_torchvision, save_vlm_model, shape_pairs

# The families trained sharded: Qwen2.5-VL too where torchvision is installed.
TRAINED = (*FAMILIES, *(("qwen2_5_vl",) if HAS_TORCHVISION else ()))
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

STEPS = {"llava": 60, "idefics3": 16, "gemma3": 16, "qwen2_5_vl": 16}  # LLaVA long enough to learn colours; the others to move
# Resumed exactly after SIGTERM: 8 of an epoch's 28 steps, fp32, the images decoded in a data worker.
# GRPO on the shapes' colour questions, rewarded for the letters of the image's colour: dense, so a
# tiny model learns it in a few dozen steps. The reward functions get the images decoded.
REWARDS = '''
from PIL import Image


def colour_letters(prompts, completions, completion_ids, images, answer, **columns):
    """The share of the answer's letters that are letters of the image's colour's name."""
    assert all(isinstance(shown[0], Image.Image) for shown in images)
    scores = []
    for completion, colour in zip(completions, answer):
        letters = [c for c in completion[0]["content"].lower() if c.isalpha()]
        scores.append(sum(c in colour for c in letters) / max(len(letters), 1))
    return scores
'''
# LoRA on the language model, the projector and the output layer, where a tiny model's preferred words
# move first (all-linear leaves the output layer out): learning that does not hang on one torch's rounding.
LORA_WITH_HEAD = ["--peft", "lora", "--lora_target_modules",
                  "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head,linear_1,linear_2"]
RESUMED = ["--max_steps", "8", "--checkpoint_every", "2", "--per_device_batch_size", "8", "--learning_rate", "3e-3",
           "--block_size", "256", "--dataloader_num_workers", "1", "--log_format", "plain"]


@pytest.fixture(scope="module")
def vlms(tmp_path_factory, worker_id) -> Path:
    return made_once(tmp_path_factory, worker_id, "vlm-models",
                     lambda root: [save_vlm_model(root / family, family) for family in TRAINED])


@pytest.fixture(scope="module")
@launches
def vision_runs(vlms, tmp_path_factory, env) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision-runs")
    runs = {name: root / name for name in (*TRAINED, "llava-ddp", "llava-straight", "llava-lora", "dpo", "dpo-lora",
                                           "grpo", "grpo-lora", "grpo-straight", "grpo-zero3", "stream")}
    shapes = build_shapes(cache=root)
    pairs = shape_pairs(shapes)
    colours = shapes.with_name("colours.jsonl")  # beside the images
    colours.write_text("".join(line + "\n" for line in shapes.with_name("prompts.jsonl").read_text().splitlines()
                               if json.loads(line)["answer"] in COLOURS))
    (root / "rewards.py").write_text(REWARDS)
    stored = stored_images(shapes, root / "shapes.parquet")
    grpo = [*grpo_args(colours, root / "rewards.py"), "--max_steps", "24"]
    dpo = ["--method", "dpo", "--dataset", pairs, "--max_steps", "24", "--eval_every", "24", "--per_device_batch_size",
           "8", "--block_size", "256", "--dpo_beta", "1", "--lr_scheduler_type", "constant", "--warmup_ratio", "0"]
    train = ["train", "--task", "image-text-to-text", "--model"]
    procs = run_cli_together([
        *((train + [vlms / family, "--output_dir", runs[family], "--max_steps", STEPS[family], "--eval_every",
                    STEPS[family], "--per_device_batch_size", "8", "--learning_rate", "3e-3", "--block_size", "256",
                    "--log_format", "plain"], {}) for family in TRAINED),
        (train + [vlms / "llava", "--output_dir", runs["llava-ddp"], "--max_steps", "12", "--eval_every", "12",
                  "--per_device_batch_size", "8", "--learning_rate", "3e-3", "--block_size", "256"],
         {"config": "ddp.yaml"}),
        (train + [vlms / "llava", "--output_dir", runs["llava-straight"], *RESUMED], {"mixed_precision": "no"}),
        (train + [vlms / "llava", "--output_dir", runs["llava-lora"], "--peft", "lora", "--max_steps", "6",
                  "--per_device_batch_size", "8", "--learning_rate", "1e-2", "--block_size", "256"], {}),
        (train + [vlms / "llava", "--output_dir", runs["dpo"], *dpo, "--learning_rate", "3e-3"], {}),
        (train + [vlms / "llava", "--output_dir", runs["dpo-lora"], *dpo, "--learning_rate", "3e-2", *LORA_WITH_HEAD], {}),
        (train + [vlms / "llava", "--output_dir", runs["grpo"], *grpo, "--learning_rate", "2e-2"], {}),
        (train + [vlms / "llava", "--output_dir", runs["grpo-lora"], *grpo, "--learning_rate", "5e-2", *LORA_WITH_HEAD],
         {}),
        (train + [vlms / "gemma3", "--output_dir", runs["grpo-straight"], *GRPO_RESUMED(colours, root)],
         {"mixed_precision": "no"}),
        (train + [vlms / "llava", "--output_dir", runs["stream"], *STREAMED(stored)], {"mixed_precision": "no"}),
        *([(train + [vlms / "llava", "--output_dir", runs["grpo-zero3"], *grpo, "--learning_rate", "2e-2"],
            {"config": "zero3.yaml"})] if HAS_DEEPSPEED else [])], env)
    for proc in procs:
        check_ok(proc)
    return runs


def STREAMED(data: Path) -> list:
    """A stream of parquet rows whose images are bytes (datasets' Image column), read across two passes,
    each rank's rows checked in a worker process; a checkpoint in the middle."""
    return ["--dataset", data, "--streaming", "--max_steps", "10", "--checkpoint_every", "5", "--eval_every", "10",
            "--per_device_batch_size", "8", "--learning_rate", "3e-3", "--block_size", "256",
            "--dataloader_num_workers", "1", "--log_format", "plain"]


def stored_images(shapes: Path, path: Path, count: int = 128) -> Path:
    from datasets import Dataset, Image, Sequence

    rows = [json.loads(line) for line in shapes.read_text().splitlines()[:count]]
    images = [[{"bytes": (shapes.parent / name).read_bytes(), "path": None} for name in row["images"]] for row in rows]
    Dataset.from_dict({"messages": [row["messages"] for row in rows], "images": images}).cast_column(
        "images", Sequence(Image())).to_parquet(str(path))
    return path


def grpo_args(prompts: Path, rewards: Path) -> list:
    return ["--method", "grpo", "--dataset", prompts, "--reward_funcs", f"{rewards}:colour_letters",
            "--num_generations", "4", "--per_device_batch_size", "8", "--max_completion_length", "8", "--block_size",
            "128", "--max_eval_samples", "16", "--lr_scheduler_type", "constant", "--log_format", "plain"]


def GRPO_RESUMED(prompts: Path, root: Path) -> list:
    """Gemma 3 (its token types ride along), fp32, two steps a rollout, a checkpoint in the middle of one."""
    return [*grpo_args(prompts, root / "rewards.py"), "--max_steps", "4", "--num_iterations", "2", "--checkpoint_every",
            "1", "--learning_rate", "1e-2"]


def _batch(processor, rows: list[dict], root: Path) -> dict:
    texts = [processor.apply_chat_template(row["messages"], tokenize=False) for row in rows]
    images = [[Image.open(root / name).convert("RGB") for name in row["images"]] for row in rows]
    return processor(text=texts, images=images, padding=True, add_special_tokens=False, return_tensors="pt")


def test_each_family_trains_sharded_and_exports_to_the_same_logits(vision_runs, tmp_path):
    """Every family's weights were split over the ranks, its held-out answer
    loss fell, and final/ and an export of the last checkpoint are the same
    model to transformers (its Auto class and processor)."""
    for family in FAMILIES:
        _trained_sharded_and_exported(vision_runs[family], family, tmp_path)


@needs_torchvision
def test_qwen_vl_trains_sharded_and_exports_to_the_same_logits(vision_runs, tmp_path):
    """Qwen2.5-VL: its images as flattened patches with their grids, its 3-D rotary positions."""
    _trained_sharded_and_exported(vision_runs["qwen2_5_vl"], "qwen2_5_vl", tmp_path)


def _trained_sharded_and_exported(run: Path, family: str, tmp_path: Path) -> None:
    fresh = build_shapes(count=4, seed=1, cache=tmp_path)
    rows = [json.loads(line) for line in fresh.read_text().splitlines()]
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


def test_ddp_trains_the_same_model(vision_runs):
    summary = json.loads((vision_runs["llava-ddp"] / "summary.json").read_text())
    assert summary["distributed_type"] == "MULTI_CPU"
    first, last = eval_rows(vision_runs["llava-ddp"])[0], eval_rows(vision_runs["llava-ddp"])[-1]
    assert last["eval_loss"] < first["eval_loss"] - 0.3, (first, last)


def test_a_run_stopped_by_sigterm_mid_epoch_resumes_to_the_same_weights(vision_runs, vlms, tmp_path, env):
    stopped = tmp_path / "stopped"
    err = stopped_by_sigterm(["train", "--task", "image-text-to-text", "--model", vlms / "llava", "--output_dir", stopped,
                              *RESUMED], env, stopped / "checkpoints" / "step_000004")
    assert "stopped: SIGTERM at step" in err, err[-3000:]
    check_ok(run_cli(["resume", stopped], env, mixed_precision="no", warm=True))
    straight = vision_runs["llava-straight"]
    assert [round(r["loss"], 6) for r in train_rows(stopped)][-4:] == [round(r["loss"], 6) for r in train_rows(straight)][-4:]
    theirs, ours = load_file(straight / "final" / "model.safetensors"), load_file(stopped / "final" / "model.safetensors")
    assert theirs.keys() == ours.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_lora_adapts_the_language_model_and_projector_and_exports_merged(vision_runs, vlms, tmp_path):
    """The tower is frozen by default: LoRA leaves it as loaded; the merged
    export of the last checkpoint is final/ to the bit."""
    run = vision_runs["llava-lora"]
    check_ok(run_in_process("export", run, "--output", tmp_path / "merged"))
    final, merged = load_file(run / "final" / "model.safetensors"), load_file(tmp_path / "merged" / "model.safetensors")
    assert final.keys() == merged.keys() and all(torch.equal(final[k], merged[k]) for k in final)
    base = AutoModelForImageTextToText.from_pretrained(vlms / "llava").state_dict()
    trained = AutoModelForImageTextToText.from_pretrained(run / "final").state_dict()
    moved = {name for name in base if not torch.equal(base[name], trained[name])}
    assert not any(".vision_tower." in name for name in moved)
    assert any(".multi_modal_projector." in name for name in moved) and any(".language_model." in name for name in moved)


def test_evaluate_scores_the_runs_held_out_images_as_the_run_did(vision_runs):
    run = vision_runs["llava"]
    proc = run_in_process("evaluate", run / "final")
    check_ok(proc)
    scored = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(scored["eval_loss"] - eval_rows(run)[-1]["eval_loss"]) < 0.02, (scored, eval_rows(run)[-1])  # bf16 run


@pytest.mark.parametrize("run", ["dpo", "dpo-lora"])
def test_dpo_on_image_pairs_learns_sharded_with_every_weight_and_with_lora(run, vision_runs):
    """TRL's pairs with images: the held-out preference loss falls from ln 2
    (the policy starts as its reference) and the pairs are ranked right, the
    weights sharded; LoRA's reference is the base with the adapters off."""
    summary = json.loads((vision_runs[run] / "summary.json").read_text())
    assert summary["method"] == "dpo" and summary["distributed_type"] == "FSDP"
    assert all(n < 0.6 * summary["total_params"] for n in summary["local_params_per_rank"])
    first, last = eval_rows(vision_runs[run])[0], eval_rows(vision_runs[run])[-1]
    assert abs(first["eval_loss"] - 0.6931) < 1e-3, first
    assert last["eval_loss"] < 0.64 and last["eval_rewards/accuracies"] > 0.6, last


@pytest.mark.parametrize("run", ["grpo", "grpo-lora", pytest.param("grpo-zero3", marks=pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="DeepSpeed is not installed"))])
def test_grpo_on_prompts_with_images_learns_sharded_with_every_weight_and_with_lora(run, vision_runs):
    """TRL's prompt-only rows with images: the model samples answers about
    each image, the reward functions get the images, and the greedy answers
    to held-out images score higher at the end; the weights are sharded
    (FSDP2, and ZeRO-3, whose sampling replica is built whole beside them)."""
    summary = json.loads((vision_runs[run] / "summary.json").read_text())
    assert summary["method"] == "grpo" and summary["distributed_type"] == ("DEEPSPEED" if "zero" in run else "FSDP")
    assert all(n < 0.6 * summary["total_params"] for n in summary["local_params_per_rank"])
    assert summary["last_eval"]["reward"] > summary["first_eval"]["reward"] + 0.2, (summary["first_eval"],
                                                                                      summary["last_eval"])
    rewards = [row["reward"] for row in train_rows(vision_runs[run])]  # of the sampled answers
    assert sum(rewards[-4:]) > sum(rewards[:4]) + 4 * 0.2, [round(r, 2) for r in rewards]


def test_grpo_on_images_resumed_in_the_middle_of_a_rollout_takes_the_same_steps(vision_runs, vlms, tmp_path, env):
    """The checkpoint keeps the rollout's completions, not its pixels: the
    resumed run makes them again from the rows and trains to the same weights."""
    import shutil

    straight = vision_runs["grpo-straight"]
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("final", "step_00000[234]"))
    progress = json.loads((resumed / "checkpoints" / "step_000001" / "training_progress.json").read_text())
    assert progress["rollout"]["uses_left"] == 1 and "pixel_values" not in progress["rollout"]["batches_per_rank"][0][0]
    rewards = f"{straight.parent / 'rewards.py'}:colour_letters"  # user code runs only when the command line names it
    check_ok(run_cli(["resume", resumed, "--reward_funcs", rewards], env, mixed_precision="no", warm=True))
    theirs, ours = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    base = AutoModelForImageTextToText.from_pretrained(vlms / "gemma3").state_dict()
    trained = AutoModelForImageTextToText.from_pretrained(straight / "final").state_dict()
    assert any(not torch.equal(base[name], trained[name]) for name in base)  # the steps moved the weights
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_a_stream_of_stored_images_resumes_to_the_same_weights(vision_runs, tmp_path, env):
    """--streaming a parquet file whose images are bytes: the rows are read as
    training goes (each checked as it is read), the loss falls, and a resume
    from the checkpoint in the middle reads on from there to the same weights."""
    import shutil

    straight = vision_runs["stream"]
    first, last = eval_rows(straight)[0], eval_rows(straight)[-1]
    assert last["eval_loss"] < first["eval_loss"] - 0.3, (first, last)
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("final", "step_000010"))
    check_ok(run_cli(["resume", resumed], env, mixed_precision="no", warm=True))
    theirs, ours = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
