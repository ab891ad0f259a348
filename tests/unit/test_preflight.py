"""Unit tests of the checks a training command makes before the libraries
load (finetune/preflight.py, finetune/data/locations.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from finetune.data.locations import TEXT_FILES, locate
from finetune.errors import UsageError


# Each run through `main`, as a rank runs it, in one fresh process under its own
# environment additions; then which of the heavy libraries that process imported.
RUNS_IN_ONE_PROCESS = """
import contextlib, io, json, os, sys
from finetune.cli import main
results = []
for environment, argv in json.loads(sys.argv[1]):
    saved = dict(os.environ)
    os.environ.update(environment)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    os.environ.clear()
    os.environ.update(saved)
    results.append((code, err.getvalue()))
print(json.dumps({"results": results, "loaded": [m for m in ("torch", "transformers", "datasets", "accelerate")
                                                 if m in sys.modules]}))
"""


def one_line_refusals(runs: list[tuple[dict, list[str], str]]) -> list[str]:
    """Each (environment, train ARGS, words) run exits 2 with one line holding
    the words; returns the heavy libraries the process imported."""
    argvs = [(environment, ["train", *args]) for environment, args, _ in runs]
    proc = subprocess.run([sys.executable, "-c", RUNS_IN_ONE_PROCESS, json.dumps(argvs)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    for (environment, args, words), (code, stderr) in zip(runs, found["results"]):
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], \
            (environment, args, stderr)
    return found["loaded"]


def test_a_dataset_value_is_located_by_the_file_system_alone(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "train.txt").write_text("x\n")
    (tmp_path / "dir" / "notes.md").write_text("x\n")
    (tmp_path / "card").mkdir()
    (tmp_path / "card" / "README.md").write_text("---\n---\n")
    assert locate("builtin", TEXT_FILES).kind == "builtin"
    assert locate("user/corpus", TEXT_FILES).kind == "hub"
    assert locate(str(tmp_path / "card"), TEXT_FILES).kind == "card"
    assert locate(str(tmp_path / "a.jsonl"), TEXT_FILES).files == (tmp_path / "a.jsonl",)
    assert locate(str(tmp_path / "dir"), TEXT_FILES).files == (tmp_path / "dir" / "train.txt",)  # the task's types
    assert locate(str(tmp_path / "*.jsonl"), TEXT_FILES).files == (tmp_path / "a.jsonl",)
    for missing, words in ((str(tmp_path / "b.jsonl"), "does not exist"), ("./corpus", "does not exist"),
                           ("notes.jsonl.gz", "does not exist"), (str(tmp_path / "*.parquet"), "matches no file")):
        with pytest.raises(UsageError, match=words):
            locate(missing, TEXT_FILES)


def test_bad_paths_end_before_torch_transformers_or_datasets_load(tmp_path):
    """Each case through `main`, as a rank runs it, in one fresh process: exit
    2 and one line each, and none of the heavy libraries imported."""
    (tmp_path / "notes.txt").write_text("some text\n")
    (tmp_path / "a_file").write_text("")
    data = str(tmp_path / "notes.txt")
    for name, files in (("no_config", {"model.safetensors": ""}), ("no_tokenizer", {"config.json": "{}"}),
                        ("a_shard_missing", {"config.json": "{}", "tokenizer.json": "{}", "model.safetensors.index.json":
                                             '{"weight_map": {"w": "model-00001-of-00002.safetensors"}}'})):
        (tmp_path / name).mkdir()
        for file, text in files.items():
            (tmp_path / name / file).write_text(text)
    cases = [
        (["--dataset", data, "--model", str(tmp_path / "no_config")], "is not a model directory (no config.json)"),
        (["--dataset", data, "--model", str(tmp_path / "no_tokenizer")], "no_tokenizer has no tokenizer"),
        (["--dataset", data, "--model", str(tmp_path / "a_shard_missing")],
         "names model-00001-of-00002.safetensors, which is not in"),
        (["--dataset", data, "--model", data], "notes.txt is a file, and not a GGUF file"),
        (["--dataset", data, "--method", "dpo", "--reference_model", "tiny-gpt2"], "is a preset, built from scratch"),
        (["--dataset", str(tmp_path / "none.txt")], "none.txt does not exist"),
        (["--dataset", data, str(tmp_path / "more.jsonl")], "more.jsonl does not exist"),
        (["--dataset", str(tmp_path / "shard-*.jsonl.gz")], "matches no file"),
        (["--dataset", data, "--model", str(tmp_path / "model_dir")], "model_dir does not exist"),
        (["--dataset", data, "--model", str(tmp_path / "model.Q8_0.gguf")], "pass an existing .gguf file"),
        (["--dataset", data, "--model", "tiny-gpt2", "--chat_template", str(tmp_path / "t.jinja")],
         "t.jinja does not exist"),
        (["--dataset", data, "--output_dir", str(tmp_path / "a_file")], "is a file, not a directory"),
        (["--dataset", data, "--model", "lecture-cnn"], "is for --task image-classification"),
        (["--dataset", data, "--method", "dpo", "--reference_model", "./gone"], "--reference_model ./gone does not"),
    ]
    run = ["--output_dir", str(tmp_path / "run")]
    assert one_line_refusals([({}, [*run, *args], words) for args, words in cases]) == []
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("named", ["/etc/passwd", "../secret/*.jsonl", "~/notes.jsonl", "hf://datasets/x/y.csv"])
def test_a_dataset_card_that_names_files_outside_its_dir_is_refused(tmp_path, named):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "x"}\n')
    for files in ([{"split": "train", "path": "train.jsonl"}, {"split": "test", "path": named}], named,
                  {"train": ["train.jsonl", named]}):
        (data / "README.md").write_text("---\n" + yaml.safe_dump({"configs": [{"config_name": "default",
                                                                              "data_files": files}]}) + "---\n")
        with pytest.raises(UsageError, match="its README.md card names the data file .*outside the dir"):
            locate(str(data), TEXT_FILES)
    (data / "README.md").write_text("---\n" + yaml.safe_dump({"configs": [{"config_name": "default", "data_files": [
        {"split": "train", "path": "train*.jsonl"}]}]}) + "---\n# My data\n")
    assert locate(str(data), TEXT_FILES).kind == "card"



@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusals of a machine without a GPU")
def test_what_needs_a_gpu_ends_before_transformers_or_datasets_load(tmp_path):
    """The launch's environment as `accelerate launch` sets it from each config,
    through `main` in one fresh process: exit 2 and one line each, with torch
    imported to ask for devices and nothing heavier."""
    (tmp_path / "notes.txt").write_text("some text\n")
    fsdp = {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}
    cases = [
        ({**fsdp, "FSDP_VERSION": "1"}, [], "fsdp_version: 1 (FSDP1) needs a GPU"),
        ({**fsdp, "FSDP_OFFLOAD_PARAMS": "true"}, [], "fsdp_offload_params: true (CPU offload) needs a GPU"),
        (fsdp, ["--peft", "qlora"], "--peft qlora holds the base in 4 bits, which needs a CUDA GPU"),
        ({"WORLD_SIZE": "2", "FINETUNE_QLORA_ON_CPU": "1"}, ["--peft", "qlora"], "with FSDP2 only"),  # DDP
        ({"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "2", "FINETUNE_QLORA_ON_CPU": "1"}, ["--peft", "qlora"],
         "with FSDP2 only"),
        ({**fsdp, "FSDP_VERSION": "1", "FINETUNE_QLORA_ON_CPU": "1"}, ["--peft", "qlora"], "(FSDP1) needs a GPU"),
        (fsdp, ["--attn_implementation", "flex_attention"], "flex_attention trains on CUDA GPUs only"),
        ({}, ["--attn_implementation", "flash_attention_2"], "backward on this machine); pass --attn_implementation sdpa"),
        (fsdp, ["--use_liger_kernel"], "--use_liger_kernel runs Triton kernels, which need a CUDA GPU; drop it"),
    ]
    run = ["--dataset", str(tmp_path / "notes.txt"), "--output_dir", str(tmp_path / "run")]
    loaded = one_line_refusals([(environment, [*run, *args], words) for environment, args, words in cases])
    assert "transformers" not in loaded and "datasets" not in loaded and "accelerate" not in loaded, loaded
    assert not (tmp_path / "run").exists()


def test_a_dry_run_checks_what_train_checks_first_and_writes_nothing(tmp_path):
    """`train --dry_run`: exit 0 and one line when the command checks out, the
    same one-line refusal as `train` when it does not; no model, data or
    libraries beyond torch loaded, and nothing written."""
    (tmp_path / "notes.txt").write_text("some text\n")
    check = ("import sys; from finetune.cli import main; code = main(sys.argv[1:]); "
             "print([m for m in ('transformers', 'datasets', 'accelerate') if m in sys.modules]); sys.exit(code)")
    ok = subprocess.run([sys.executable, "-c", check, "train", "--model", "tiny-gpt2", "--dataset", "notes.txt",
                         "--output_dir", "outputs/run", "--dry_run"], cwd=tmp_path, capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    line, loaded = ok.stdout.strip().splitlines()
    assert line.startswith("dry run: ") and "run dir outputs/run" in line and "nothing was loaded" in line
    assert line.endswith("what only loading shows is not checked: the data's rows, the weights' shapes")
    assert loaded == "[]" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    bad = subprocess.run([sys.executable, "-m", "finetune", "train", "--model", "tiny-gpt2", "--dataset", "none.txt",
                          "--dry_run"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "none.txt does not exist" in lines[0], bad.stderr


CHECKS_A_RESUME = """
import json, sys
from pathlib import Path
from finetune.config import load_config
from finetune.errors import UsageError
from finetune.preflight import check_resume
run = Path(sys.argv[1])
results = []
for overrides, processes, damage in json.loads(sys.argv[2]):
    if damage:
        with open(run / "checkpoints" / "step_000002" / "scheduler.bin", "ab") as f:
            f.write(b"x")
    try:
        cfg = load_config(run / "run_config.yaml", {"resume_from_checkpoint": "latest", "output_dir": str(run), **overrides})
        results.append(str(check_resume(cfg, processes)))
    except UsageError as e:
        results.append(f"error: {e}")
print(json.dumps({"results": results, "loaded": [m for m in ("torch", "transformers", "datasets", "accelerate")
                                                 if m in sys.modules]}))
"""


def test_a_resume_is_checked_before_the_libraries_load(tmp_path):
    """preflight.check_resume, on a run dir with one checkpoint (a stream's, of
    2 ranks): what it refuses, and that it imports none of the heavy libraries."""
    from finetune.manifest import write_manifest

    (tmp_path / "notes.txt").write_text("a note\n")
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    recorded = yaml.safe_dump({"model": "tiny-gpt2", "dataset": str(tmp_path / "notes.txt"), "output_dir": str(run),
                               "block_size": 64})
    for config in (run / "run_config.yaml", checkpoint / "run_config.yaml"):
        config.write_text(recorded)
    (checkpoint / "training_progress.json").write_text(json.dumps({"step": 2, "world_size": 2,
                                                                   "stream_positions": [3, 4]}))
    (checkpoint / "scheduler.bin").write_bytes(b"the scheduler's state")
    write_manifest(checkpoint)
    cases = [({}, 2, False), ({"block_size": 32}, 2, False), ({}, 3, False), ({}, 2, True)]
    proc = subprocess.run([sys.executable, "-c", CHECKS_A_RESUME, str(run), json.dumps(cases)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    ok, changed, other_world, damaged = found["results"]
    assert ok == str(checkpoint)
    assert "a resume cannot change --block_size (64 -> 32)" in changed
    assert "stream positions are those of 2 ranks" in other_world and "--num_processes 2" in other_world
    assert f"{checkpoint / 'scheduler.bin'} does not match the checksum" in damaged
    assert found["loaded"] == []
