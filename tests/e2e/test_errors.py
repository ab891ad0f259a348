"""Every kind of bad input, run as a user runs it: one line naming the problem
and the fix, exit code 2, no traceback, and the files around it unchanged.

Single-process cases go through `finetune.cli.main` (what the console script
calls) in this process; the cases that depend on several ranks run under
`accelerate launch` with 2 processes. The messages seen here are the ones the
troubleshooting page lists (`test_the_troubleshooting_page_lists_every_message`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from conftest import CONFIGS, REPO, check_ok, common_args, free_port, run_cli, run_in_process, train_rows
from finetune.checkpoint import verify_checkpoint
from finetune.errors import UsageError
from finetune.lock import LOCK_FILE

TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
SEEN: dict[str, str] = {}  # case id -> message, with the test's paths replaced by placeholders


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with a hash of its content."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def one_error_line(stderr: str) -> str:
    """Progress bars may come before it; the output ends with the one error line."""
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    assert errors == [lines[-1]] and lines[-1].startswith("error: "), stderr[-3000:]
    assert "Traceback" not in stderr
    return lines[-1]


def remember(case: str, line: str, tmp_path: Path) -> None:
    """As the troubleshooting page shows it: the test's paths as DIR, step numbers as N (they vary with timing)."""
    line = line.replace(str(tmp_path), "DIR")
    SEEN[case] = re.sub(r"step_\d{6}", "step_NNNNNN", re.sub(r"step \d+", "step N", line))


# --- single process -------------------------------------------------------------------------------

def _tiny_text(tmp: Path) -> Path:
    (tmp / "tiny.txt").write_text("Only a few words here.\n")
    return tmp / "tiny.txt"


def _jsonl_with_body(tmp: Path) -> Path:
    (tmp / "notes.jsonl").write_text(json.dumps({"body": "some text " * 50}) + "\n")
    return tmp / "notes.jsonl"


def _bad_parquet(tmp: Path) -> Path:
    (tmp / "broken.parquet").write_bytes(b"this is not parquet" * 10)
    return tmp / "broken.parquet"


def _empty_file(tmp: Path) -> Path:
    (tmp / "empty.txt").write_text("")
    return tmp / "empty.txt"


def _not_a_model(tmp: Path) -> Path:
    (tmp / "weights").mkdir()
    (tmp / "weights" / "model.bin").write_bytes(b"\0" * 16)
    return tmp / "weights"


def _existing_run(tmp: Path) -> Path:
    (tmp / "run" / "checkpoints" / "step_000004").mkdir(parents=True)
    (tmp / "run" / "run_config.yaml").write_text("max_steps: 4\n")
    (tmp / "run" / "checkpoints" / "step_000004" / "training_progress.json").write_text('{"step": 4}')
    return tmp / "run"


def _images_without_labels(tmp: Path) -> Path:
    from finetune.data.digits import build_digits

    build_digits()["train"].select(range(64)).remove_columns("label").to_parquet(str(tmp / "images.parquet"))
    return tmp / "images.parquet"


def _chat_model(tmp: Path, template: str | None = None) -> list[str]:
    from sft_models import CHATML, save_chat_model

    return ["--model", str(save_chat_model(tmp / "chat-model", template=CHATML if template is None else template))]


def _moe_model(tmp: Path) -> list[str]:
    from sft_models import save_family_model

    return ["--model", str(save_family_model(tmp / "moe-model", "qwen3_moe"))]


def _chat_rows(tmp: Path, *rows) -> list[str]:
    (tmp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["--dataset", str(tmp / "chat.jsonl")]


def _vlm_rows(tmp: Path, images: list[str], make: tuple[str, ...] = ("red.png",), model: bool = True) -> list[str]:
    """A tiny LLaVA and one image chat row showing `images` (paths relative to the data file)."""
    from PIL import Image
    from vlm_models import save_vlm_model

    data = tmp / "images-data"
    data.mkdir()
    for name in make:
        Image.new("RGB", (8, 8), (255, 0, 0)).save(data / name)
    (data / "notes.txt").write_text("not an image")
    row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "images": images}
    (data / "rows.jsonl").write_text(json.dumps(row) + "\n")
    vlm = ["--task", "image-text-to-text", "--model", str(save_vlm_model(tmp / "llava", "llava"))] if model else []
    return [*vlm, "--dataset", str(data / "rows.jsonl"), "--block_size", "64"]


def _template_without_system(tmp: Path) -> Path:
    (tmp / "no-system.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endfor %}")
    return tmp / "no-system.jinja"


ANSWERED = [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": "A tiny test."}]

GRPO_REWARDS = '''
def raises(prompts, completions, completion_ids, **columns):
    raise ValueError("no score for you")


def wrong_length(prompts, completions, completion_ids, **columns):
    return [1.0]


def not_numbers(prompts, completions, completion_ids, **columns):
    return ["high"] * len(completions)


def too_large(prompts, completions, completion_ids, **columns):
    return [1e308] * len(completions)


def exits(prompts, completions, completion_ids, **columns):
    import sys
    sys.exit(3)


def hangs(prompts, completions, completion_ids, **columns):
    import time
    time.sleep(3600)
'''


def _grpo(tmp: Path, reward: str = "format", *extra: str, rows: list | None = None) -> list[str]:
    """A GRPO run of a tiny chat model on a few prompts, scored by `reward`:
    a built-in, or a function of GRPO_REWARDS (NAME) in a file of the user's."""
    (tmp / "rewards.py").write_text(GRPO_REWARDS)
    rows = rows or [{"prompt": [{"role": "user", "content": f"say {w}"}], "answer": w} for w in "abcdefgh"]
    spec = reward if reward in ("format", "exact_match") or ":" in reward else f"{tmp / 'rewards.py'}:{reward}"
    return [*_chat_model(tmp), *_chat_rows(tmp, *rows), "--method", "grpo", "--reward_funcs", spec,
            "--num_generations", "2", "--per_device_batch_size", "2", "--max_completion_length", "4",
            "--block_size", "32", "--max_eval_samples", "2", "--reward_timeout", "1", *extra]


def _task_without_data(tmp: Path) -> Path:
    (tmp / "tasks").mkdir()
    (tmp / "tasks" / "my_qa.yaml").write_text(
        "task: my_qa\ndataset_path: json\ndataset_kwargs:\n  data_files: /nonexistent/qa.jsonl\ntest_split: train\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\noutput_type: generate_until\n"
        "generation_kwargs:\n  until: ['\\n']\n")
    return tmp / "tasks"


def _latin1_jsonl(tmp: Path, compressed: bool = False) -> Path:
    import gzip

    content = '{"text": "caf\u00e9 au lait"}\n'.encode("latin-1")
    path = tmp / ("latin1.jsonl.gz" if compressed else "latin1.jsonl")
    path.write_bytes(gzip.compress(content) if compressed else content)
    return path


def _a_file(tmp: Path) -> Path:
    (tmp / "notes.txt").write_text("not a dir\n")
    return tmp / "notes.txt"


def _binary_text_parquet(tmp: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [b"\x00\x01 raw bytes", b"more bytes"]}), str(tmp / "bytes.parquet"))
    return tmp / "bytes.parquet"

CASES = {
    "missing data": (lambda t: ["--dataset", str(t / "no_such_file.txt")], "does not exist"),
    "empty data": (lambda t: ["--dataset", str(_empty_file(t))], "is empty"),
    "unreadable data": (lambda t: ["--dataset", str(_bad_parquet(t))], "could not read"),
    "mixture weights that do not match the sources": (
        lambda t: ["--dataset", "builtin", "builtin", "--dataset_weights", "1"], "1 weight(s) for 2 --dataset source(s)"),
    "a stream without --max_steps": (lambda t: ["--streaming", "--max_steps", "0", "--num_epochs", "1"],
                                     "--streaming needs --max_steps"),
    "a data glob that matches nothing": (lambda t: ["--dataset", str(t / "shard-*.jsonl")], "matches no file"),
    "missing text column": (lambda t: ["--dataset", str(_jsonl_with_body(t))], "has no column 'text'"),
    "missing label column": (lambda t: ["--task", "image-classification", "--dataset", str(_images_without_labels(t))],
                             "has no column 'label'"),
    "too little text for one block": (lambda t: ["--dataset", str(_tiny_text(t))], "fewer than one block"),
    "not a model": (lambda t: ["--model", str(_not_a_model(t))], "is not a model directory"),
    "model for another task": (lambda t: ["--task", "image-classification", "--model", "tiny-gpt2"],
                               "is for --task causal-lm"),
    "another run's output dir": (lambda t: ["--output_dir", str(_existing_run(t))], "already holds a run"),
    "misspelt option": (lambda t: ["--learning_rte", "0.1"], "did you mean --learning_rate?"),
    "value out of range": (lambda t: ["--validation_split", "1.5"], "--validation_split must be between 0 and 1"),
    "wrong type": (lambda t: ["--max_steps", "ten"], "max_steps: expected int"),
    "unknown report_to": (lambda t: ["--report_to", "comet"], "--report_to 'comet' is not supported"),
    "a tracker that cannot start": (lambda t: ["--report_to", "wandb"], "a tracker could not start"),
    "messages that are not a list of turns": (
        lambda t: [*_chat_model(t), *_chat_rows(t, {"messages": ANSWERED}, {"messages": ["just a string"]})],
        "example 2: messages must be a non-empty list"),
    "an unknown role": (
        lambda t: [*_chat_model(t), *_chat_rows(t, {"messages": [{"role": "narrator", "content": "Once"}, *ANSWERED]})],
        "unknown role(s) 'narrator'"),
    "a conversation without an answer": (
        lambda t: [*_chat_model(t), *_chat_rows(t, {"messages": ANSWERED}, {"messages": ANSWERED[:1]})],
        "example 2: the conversation has no assistant turn"),
    "chat data and a tokenizer without a chat template": (
        lambda t: [*_chat_model(t, template=""), *_chat_rows(t, {"messages": ANSWERED})],
        "has none; pass --chat_template FILE"),
    "a data format the columns contradict": (
        lambda t: [*_chat_model(t), *_chat_rows(t, {"messages": ANSWERED}), "--data_format", "instruction"],
        "--data_format instruction needs the column(s) instruction, output"),
    "an accelerate launch option after the command": (lambda t: ["--num_processes", "2"],
                                                      "--num_processes is an `accelerate launch` option"),
    "a split the data does not have": (lambda t: ["--dataset", str(_jsonl_with_body(t)), "--text_column", "body",
                                                  "--eval_split", "dev"], "'dev' is not a split of the data"),
    "a GGUF file that does not exist": (lambda t: ["--model", str(t / "model.Q4_0.gguf")],
                                        "model.Q4_0.gguf does not exist; pass an existing .gguf file"),
    "a chat template that refuses a conversation": (
        lambda t: [*_chat_model(t), *_chat_rows(t, {"messages": [{"role": "system", "content": "Be brief."}, *ANSWERED]}),
                   "--chat_template", str(_template_without_system(t))],
        "example 1: the chat template refused the conversation (no system turns)"),
    "a seed out of range": (lambda t: ["--seed", "-1"], "--seed must be between 0 and 4294967295, got -1"),
    "data that is not UTF-8": (lambda t: ["--dataset", str(_latin1_jsonl(t))], "is not UTF-8 text (at byte offset 13: 0xe9)"),
    "compressed data that is not UTF-8": (lambda t: ["--dataset", str(_latin1_jsonl(t, compressed=True))],
                                          "is not UTF-8 text (at byte offset 13: 0xe9 of its content); decompress it"),
    "an output dir under a file": (lambda t: ["--output_dir", str(_a_file(t) / "run")],
                                   "notes.txt is a file; choose another --output_dir"),
    "a text column that holds conversations": (  # in new parent dirs: they go too
        lambda t: [*_chat_rows(t, {"messages": ANSWERED}), "--data_format", "text", "--text_column", "messages",
                   "--output_dir", str(t / "new" / "deeper" / "run")], "column 'messages' holds list values, not text"),
    "a text column of bytes": (lambda t: ["--dataset", str(_binary_text_parquet(t))],
                               "column 'text' holds binary values, not text"),
    "GRPO data without a prompt column": (lambda t: _grpo(t, rows=[{"messages": ANSWERED}] * 8),
                                          "--method grpo trains on prompts alone (a prompt column)"),
    "GRPO: a reward file that does not exist": (lambda t: _grpo(t, str(t / "none.py:score")), "none.py does not exist"),
    "GRPO: a reward function the file does not define": (lambda t: _grpo(t, "nothing"), "defines no nothing"),
    "GRPO: a reward function that raises": (lambda t: _grpo(t, "raises"), "raised ValueError: no score for you"),
    "GRPO: a reward function that returns too few rewards": (lambda t: _grpo(t, "wrong_length"),
                                                              "returned 1 rewards for 2 completions"),
    "GRPO: a reward that is not a number": (lambda t: _grpo(t, "not_numbers"), "returned 'high' for completion 0"),
    "GRPO: a reward too large for float32": (lambda t: _grpo(t, "too_large"), "within +-1e+30"),
    "GRPO: a reward function that calls sys.exit": (lambda t: _grpo(t, "exits"), "called sys.exit(3)"),
    "GRPO: a reward function that never returns": (lambda t: _grpo(t, "hangs"), "did not return within 1 s"),
    "GRPO: exact_match without an answer column": (
        lambda t: _grpo(t, "exact_match", rows=[{"prompt": "say a"}] * 8), "lacks; add an answer column"),
    "GRPO: a --reward_pattern that is not a regular expression": (lambda t: _grpo(t, "format", "--reward_pattern", "(["),
                                                                  "is not a regular expression"),
    "GRPO: a reference model without a KL term": (lambda t: _grpo(t, "format", "--reference_model", "tiny-gpt2"),
                                                  "--beta is 0 (no KL term"),
    "dropout asked for on fused experts": (
        lambda t: ["--peft", "lora", "--lora_target_modules", "q_proj,experts", "--lora_dropout", "0.1"],
        "which peft adapts in place without dropout; pass --lora_dropout 0"),
    "a LoRA target that names nothing in a mixture of experts": (
        lambda t: [*_moe_model(t), *_chat_rows(t, {"messages": ANSWERED}), "--peft", "lora",
                   "--lora_target_modules", "q_proj,w1"], "w1, which matches no module or parameter"),
    "the router's loss on a dense model": (
        lambda t: [*_chat_model(t), *_chat_rows(t, {"messages": ANSWERED}), "--output_router_logits"],
        "applies to mixture-of-experts models"),
    "a router loss coefficient without the router's loss": (
        lambda t: ["--router_aux_loss_coef", "0.01"], "only --output_router_logits adds; add --output_router_logits"),
    "a chat template file that does not exist": (
        lambda t: [*_chat_model(t), *_chat_rows(t, {"messages": ANSWERED}), "--chat_template", str(t / "none.jinja")],
        "none.jinja does not exist; pass a Jinja template file"),
    "ORPO with a reference model": (lambda t: ["--method", "orpo", "--reference_model", "tiny-gpt2"],
                                    "--reference_model is read by --method dpo, kto, grpo or rloo, not by --method orpo"),
    "GSPO's sequence ratio for DPO": (lambda t: ["--method", "dpo", "--importance_sampling_level", "sequence"],
                                      "--importance_sampling_level is read by --method grpo or rloo"),
    "KTO data without labels": (
        lambda t: [*_chat_model(t), *_chat_rows(t, *[{"prompt": "say a\n", "completion": "a"}] * 8), "--method", "kto"],
        "--method kto trains on unpaired completions labelled desirable or not (prompt/completion/label)"),
    "KTO data of one label": (
        lambda t: [*_chat_model(t), *_chat_rows(t, *[{"prompt": f"say {w}\n", "completion": w, "label": True}
                                                      for w in "abcdefgh"]), "--method", "kto"],
        "every training completion is desirable (label true)"),
    "a causal LM's dir as a reward model": (
        lambda t: [*_chat_model(t), *_chat_rows(t, {"prompt": [{"role": "user", "content": "say a"}]}), "--method",
                   "grpo", "--reward_funcs", str(t / "chat-model")],
        "is a model dir of LlamaForCausalLM, not a reward model"),
    "GRPO: vLLM's engine where vLLM is not installed": (lambda t: _grpo(t, "format", "--generation_engine", "vllm"),
                                                        "needs vLLM, which is not installed here"),
    "GRPO: a vLLM memory share outside (0, 1)": (
        lambda t: _grpo(t, "format", "--use_vllm", "--vllm_gpu_memory_utilization", "1.5"), "must be in (0, 1)"),
    "GRPO: vLLM's server mode": (lambda t: _grpo(t, "format", "--use_vllm", "--vllm_mode", "server"),
                                 "--vllm_mode server is not built yet"),
    "GRPO: --use_vllm beside another engine": (lambda t: _grpo(t, "format", "--use_vllm", "--generation_engine", "sharded"),
                                               "--use_vllm asks for vLLM's engine and --generation_engine sharded"),
    "an image that does not exist": (lambda t: _vlm_rows(t, ["blue.png"]), "the image 'blue.png' does not exist"),
    "an image file that is not an image": (lambda t: _vlm_rows(t, ["notes.txt"]), "is not an image PIL can read"),
    "an image part without an image": (lambda t: _vlm_rows(t, []), "hold 1 image part(s) but the row gives 0"),
    "an image path outside the data's dir": (lambda t: _vlm_rows(t, ["../llava/config.json"]),
                                             "leads outside the data's dir"),
    "images for a model of text alone": (lambda t: [*_chat_model(t), *_vlm_rows(t, ["red.png"], model=False)],
                                         "which a model of text alone cannot read"),
    "precomputed reference log-probs for image pairs": (
        lambda t: ["--task", "image-text-to-text", "--method", "dpo", "--precompute_reference"],
        "--precompute_reference caches the log-probs of token pairs"),
    "packing of image rows": (lambda t: ["--task", "image-text-to-text", "--packing"],
                              "--packing is not built for rows with images"),
    "a text model for the vision task": (lambda t: [*_vlm_rows(t, ["red.png"]), *_chat_model(t)],
                                         "has no image processor: it reads text alone"),
    "vLLM's engine for prompts with images": (
        lambda t: ["--task", "image-text-to-text", "--method", "grpo", "--reward_funcs", "exact_match",
                   "--generation_engine", "vllm"], "prompts hold images; pass --generation_engine auto"),
    "a reward model on a preset built from scratch": (lambda t: ["--method", "reward"],
                                                      "--method reward puts a score head on a pretrained"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_single_process(case, tmp_path):
    make_args, expected = CASES[case]
    args = make_args(tmp_path)
    if "--output_dir" not in args:
        args += ["--output_dir", str(tmp_path / "out")]
    if "--max_steps" not in args:
        args += ["--max_steps", "2"]  # short, should a case ever train
    before = snapshot(tmp_path)
    proc = run_in_process("train", *args)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert expected in line and "; " in line, line  # the problem; then the fix
    assert snapshot(tmp_path) == before  # nothing written, nothing changed, no half-made run dir
    remember(case, line, tmp_path)


def test_config_file_with_an_unknown_key(tmp_path):
    (tmp_path / "run.yaml").write_text("max_steps: 2\nlearning_rte: 0.1\n")
    proc = run_in_process("train", "--config", tmp_path / "run.yaml", "--output_dir", tmp_path / "out")
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert "unknown key 'learning_rte'" in line and "did you mean 'learning_rate'?" in line
    assert not (tmp_path / "out").exists()
    remember("unknown key in --config", line, tmp_path)


@pytest.mark.parametrize("config, env_vars, expected", [
    ("fsdp1.yaml", {"FSDP_VERSION": "1"}, "fsdp_version: 1 (FSDP1) needs a GPU"),
    ("fsdp_offload.yaml", {"FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params: true (CPU offload) needs a GPU"),
])
def test_accelerate_config_this_machine_cannot_run(config, env_vars, expected, tmp_path, monkeypatch):
    """The environment `accelerate launch --config_file fsdp1.yaml|fsdp_offload.yaml` gives each rank."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    for key, value in env_vars.items():
        monkeypatch.setenv(key, value)
    proc = run_in_process("train", "--output_dir", tmp_path / "out")
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert expected in line and "--config_file $(finetune configs --path fsdp)" in line
    assert not (tmp_path / "out").exists()
    remember(f"{config} on a machine without GPUs", line, tmp_path)


def test_more_processes_than_gpus(tmp_path, monkeypatch):
    """As on a 1-GPU machine launched with --num_processes 2."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    proc = run_in_process("train", "--output_dir", tmp_path / "out")
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert "2 processes on this machine but only 1 GPU(s); pass --num_processes 1" in line
    assert not (tmp_path / "out").exists()
    remember("more processes than GPUs", line, tmp_path)


def test_checkpoint_of_another_model(checkpointed_run, tmp_path, small_corpus):
    saved = checkpointed_run / "checkpoints" / "step_000006"
    before = snapshot(checkpointed_run)
    proc = run_in_process("train", *common_args(small_corpus), "--model", "small-gpt2", "--max_steps", "8",
                          "--resume_from_checkpoint", saved, "--output_dir", tmp_path / "other")
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert "transformer.wte.weight is [2048, 64] in the checkpoint and [4096, 128] in the model" in line
    assert snapshot(checkpointed_run) == before and not (tmp_path / "other").exists()
    remember("a checkpoint of another model", line.replace(str(checkpointed_run), "RUN"), tmp_path)


def test_fsdp_checkpoint_without_fsdp(checkpointed_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(checkpointed_run, run_dir)
    before = snapshot(run_dir)
    proc = run_in_process("resume", run_dir, "--max_steps", "14", "--no_relaunch")  # one process, no FSDP
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert f"was written under FSDP and this run is not sharded; resume it with `finetune resume {run_dir}`" in line
    assert snapshot(run_dir) == before
    remember("an FSDP checkpoint resumed without FSDP", line, tmp_path)


def test_damaged_checkpoint(checkpointed_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(checkpointed_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000012")
    shard = run_dir / "checkpoints" / "step_000006" / "pytorch_model_fsdp_0" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    before = snapshot(run_dir)
    proc = run_in_process("resume", run_dir)
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert "__1_0.distcp is truncated (1000 of" in line and "resume from an earlier one" in line
    assert snapshot(run_dir) == before
    remember("a damaged checkpoint", re.sub(r"of \d+ bytes", "of N bytes", line), tmp_path)


OTHER_COMMANDS = {
    "export --max_shard_size abc": (lambda t, run: ["export", run, "--output", t / "out", "--max_shard_size", "abc"],
                                    "'abc' is not a size"),
    "generate --max_new_tokens -1": (lambda t, run: ["generate", run / "final", "--prompt", "The", "--max_new_tokens",
                                                     "-1"], "--max_new_tokens: must be > 0, got -1"),
    "generate with an empty prompt": (lambda t, run: ["generate", run / "final", "--prompt", " "], "--prompt is empty"),
    "a model dir that does not exist": (lambda t, run: ["evaluate", t / "no_model"], "no_model does not exist"),
    "export of a file": (lambda t, run: ["export", run / "summary.json", "--output", t / "out"],
                         "summary.json is a file; pass a run dir or a checkpoints/step_NNNNNN dir"),
    "evaluate with batch 0": (lambda t, run: ["evaluate", run / "final", "--per_device_batch_size", "0"],
                              "--per_device_batch_size: must be > 0, got 0"),
    "evaluate with a block longer than the model": (lambda t, run: ["evaluate", run / "final", "--block_size", "4096"],
                                                    "--block_size 4096 is longer than the model's 256 positions"),
    "resume into another --output_dir": (lambda t, run: ["resume", run, "--output_dir", t / "other"],
                                         "takes no --output_dir"),
    "a cut-short safetensors file": (
        lambda t, run: ["generate", _damaged_model(t, run, lambda d: os.truncate(d / "model.safetensors", 4096)),
                        "--prompt", "The"], "model.safetensors is not a whole safetensors file"),
    "a pickled .bin model": (lambda t, run: ["generate", _damaged_model(t, run, _pickled_bin), "--prompt", "The"],
                             "pytorch_model.bin is a pickle holding more than tensors"),
    "a tokenizer.json of another structure": (
        lambda t, run: ["evaluate", _damaged_model(t, run, lambda d: (d / "tokenizer.json").write_text('{"model": 5}'))],
        "tokenizer.json is not a tokenizer file"),
    "generating past the model's positions": (
        lambda t, run: ["generate", run / "final", "--prompt", "The", "--max_new_tokens", "5000"],
        "pass the 256 positions of"),
    "--tasks that names no task": (lambda t, run: ["evaluate", run / "final", "--tasks", ","], "names no task"),
    "an lm-eval task whose data is missing": (
        lambda t, run: ["evaluate", run / "final", "--tasks", "my_qa", "--tasks_dir", _task_without_data(t)],
        "could not load the data of --tasks my_qa (FileNotFoundError: "),
    "an accelerate config that is not a mapping": (
        lambda t, run: ["estimate-memory", "--model", "tiny-gpt2", "--accelerate_config", _yaml(t, "- a\n- list\n")],
        "holds a list, not the mapping of settings"),
    "a cut-short GGUF file": (lambda t, run: ["estimate-memory", "--model", _gguf(t, 1, 1, b"\x05\x00")],
                              "as GGUF ("),
    "a GGUF header asking for 2^60 tensors": (lambda t, run: ["generate", _gguf(t, 2**60, 1), "--prompt", "The"],
                                              "its GGUF header is not one a model has"),
    "GGUF export of a family llama.cpp runs and the export does not convert": (
        lambda t, run: ["export", _family_model(t, "olmo2"), "--format", "gguf", "--output", t / "model.gguf"],
        "this one is 'olmo2': export it with --format safetensors"),
    "a validation split that leaves nothing to train on": (
        lambda t, run: ["train", "--dataset", _three_documents(t), "--validation_split", "0.99", "--output_dir",
                        t / "new"], "--validation_split 0.99 of 3 samples holds out every one of them"),
}


def _family_model(tmp: Path, family: str) -> Path:
    from sft_models import save_family_model

    return save_family_model(tmp / family, family)


def _damaged_model(tmp: Path, run: Path, damage) -> Path:
    """A copy of the run's final model dir, with `damage` done to it."""
    model_dir = tmp / "model"
    shutil.copytree(run / "final", model_dir)
    damage(model_dir)
    return model_dir


def _pickled_bin(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    torch.save({"transformer.wte.weight": torch.zeros(2), "payload": Path("/etc")}, model_dir / "pytorch_model.bin")


def _gguf(tmp: Path, tensors: int, keys: int, rest: bytes = b"") -> Path:
    """A GGUF file's header (magic, version 3, the counts) and what follows it."""
    path = tmp / f"crafted-{tensors}.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + tensors.to_bytes(8, "little") + keys.to_bytes(8, "little")
                     + rest)
    return path


def _three_documents(tmp: Path) -> Path:
    (tmp / "three.txt").write_text("One document.\n\nAnother one.\n\nA third.\n")
    return tmp / "three.txt"


@pytest.mark.parametrize("case", list(OTHER_COMMANDS))
def test_bad_input_to_other_commands(case, checkpointed_run, tmp_path):
    make_args, expected = OTHER_COMMANDS[case]
    args = make_args(tmp_path, checkpointed_run)
    before, run_before = snapshot(tmp_path), snapshot(checkpointed_run)
    proc = run_in_process(*args)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert expected in line and "; " in line, line
    assert snapshot(tmp_path) == before and snapshot(checkpointed_run) == run_before
    remember(case, line.replace(str(checkpointed_run), "RUN"), tmp_path)


# --- checkpoints and outputs you can trust ---------------------------------------------------------

class RunsCode:
    """Unpickling this creates the marker file: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def copy_run(checkpointed_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(checkpointed_run, run_dir)
    return run_dir


def plant_in_metadata(checkpoint: Path, marker: Path) -> Path:
    target = checkpoint / "pytorch_model_fsdp_0" / ".metadata"
    target.write_bytes(pickle.dumps(RunsCode(marker)))
    return target


def plant_in_optimizer_item(checkpoint: Path, marker: Path) -> Path:
    """Re-point one non-tensor item of the optimizer (DCP reads those with a full
    unpickler) at a crafted torch.save payload appended to its shard."""
    shard_dir = checkpoint / "optimizer_0"
    with (shard_dir / ".metadata").open("rb") as f:
        metadata = pickle.load(f)  # the test's own checkpoint
    index = next(i for i in metadata.storage_data if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata))
    payload = io.BytesIO()
    torch.save(RunsCode(marker), payload)
    shard = shard_dir / metadata.storage_data[index].relative_path
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = _StorageInfo(shard.name, offset, len(payload.getvalue()))
    with (shard_dir / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)
    return shard


def plant_in_torch_file(name: str):
    def plant(checkpoint: Path, marker: Path) -> Path:
        torch.save(RunsCode(marker), checkpoint / name)
        return checkpoint / name
    return plant


PLANTS = {
    "model metadata": plant_in_metadata,
    "optimizer item": plant_in_optimizer_item,
    "scheduler": plant_in_torch_file("scheduler.bin"),
    "rng state": plant_in_torch_file("random_states_1.pkl"),
}


@pytest.mark.parametrize("where", list(PLANTS))
def test_a_crafted_pickle_in_a_checkpoint_runs_no_code(where, checkpointed_run, tmp_path):
    run_dir = copy_run(checkpointed_run, tmp_path)
    checkpoint = run_dir / "checkpoints" / "step_000012"
    marker = tmp_path / "code-ran"
    planted = PLANTS[where](checkpoint, marker)
    (checkpoint / "manifest.json").unlink()  # as from someone who rewrote the checkpoint whole
    with pytest.raises(UsageError, match=re.escape(str(planted))):
        verify_checkpoint(checkpoint, allow_unverified=True)
    before = snapshot(run_dir)
    proc = run_in_process("resume", run_dir, "--allow_unverified_checkpoint")  # unlaunched: refused while checking, before anything loads
    assert proc.returncode == 2 and str(planted) in one_error_line(proc.stderr)
    if where == "model metadata":
        export = run_in_process("export", run_dir, "--output", tmp_path / "out", "--allow_unverified_checkpoint")
        assert export.returncode == 2 and "which DCP metadata never does" in one_error_line(export.stderr)
        remember("a checkpoint holding code", one_error_line(export.stderr), tmp_path)
    assert not marker.exists()
    assert snapshot(run_dir) == before


def test_flipped_bytes_in_a_shard_are_refused_naming_the_file(checkpointed_run, tmp_path):
    run_dir = copy_run(checkpointed_run, tmp_path)
    shard = run_dir / "checkpoints" / "step_000012" / "pytorch_model_fsdp_0" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[4096:5120] = bytes(b ^ 0xFF for b in data[4096:5120])  # 1 KiB, same length
    shard.write_bytes(bytes(data))
    before = snapshot(run_dir)
    for command in (["resume", run_dir], ["export", run_dir, "--output", tmp_path / "out"]):
        proc = run_in_process(*command)
        assert proc.returncode == 2, proc.stderr
        line = one_error_line(proc.stderr)
        assert f"{shard} does not match the checksum its checkpoint recorded" in line
    assert snapshot(run_dir) == before and not (tmp_path / "out").exists()
    remember("a changed checkpoint file", line, tmp_path)


@pytest.mark.parametrize("output", ["the run", "a dir inside it", "the dir holding it"])
def test_export_never_writes_over_its_source(output, checkpointed_run, tmp_path):
    run_dir = copy_run(checkpointed_run, tmp_path / "runs")
    target = {"the run": run_dir, "a dir inside it": run_dir / "export", "the dir holding it": run_dir.parent}[output]
    before = snapshot(tmp_path)
    proc = run_in_process("export", run_dir, "--output", target, "--overwrite")
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert "choose an --output outside it" in line
    assert snapshot(tmp_path) == before
    remember(f"export --output {output}", line, tmp_path)


def test_outputs_that_are_files_are_one_line_errors(tmp_path, checkpointed_run, small_corpus):
    (tmp_path / "file").write_text("mine")
    export = run_in_process("export", checkpointed_run, "--output", tmp_path / "file")
    train = run_in_process("train", *common_args(small_corpus), "--output_dir", tmp_path / "file")
    for proc, case in ((export, "export --output FILE"), (train, "train --output_dir FILE")):
        assert proc.returncode == 2
        line = one_error_line(proc.stderr)
        assert "is a file, not a directory" in line
        remember(case, line, tmp_path)
    assert (tmp_path / "file").read_text() == "mine"


def test_resume_refuses_what_it_cannot_change_and_keeps_the_run_config(checkpointed_run, tmp_path):
    run_dir = copy_run(checkpointed_run, tmp_path)
    before = snapshot(run_dir)
    proc = run_in_process("resume", run_dir, "--seed", "7", "--block_size", "32")
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert "a resume cannot change --block_size (64 -> 32), --seed (42 -> 7)" in line
    assert snapshot(run_dir) == before
    remember("a resume that changes the data or optimizer", line, tmp_path)


def test_resume_finds_bad_input_before_the_libraries_load(checkpointed_run, tmp_path, env):
    """`finetune resume` typed in a shell (a process of its own, as users run
    it): a change it cannot make and a damaged checkpoint file fail before
    torch loads, each in under 3 CPU-s, with nothing relaunched."""
    run_dir = copy_run(checkpointed_run, tmp_path)
    scheduler = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "scheduler.bin"
    cases = [(["--block_size", "32"], "a resume cannot change --block_size (64 -> 32)"),
             ([], "does not match the checksum its checkpoint recorded")]
    for extra, says in cases:
        if not extra:
            scheduler.write_bytes(scheduler.read_bytes() + b"x")
        start = children_cpu_seconds()
        proc = subprocess.run([sys.executable, "-m", "finetune", "resume", str(run_dir), *extra], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        cpu_seconds = children_cpu_seconds() - start
        assert proc.returncode == 2 and says in one_error_line(proc.stderr) and "relaunching" not in proc.stdout
        assert cpu_seconds < 3, (says, cpu_seconds)


def test_a_second_live_run_in_the_same_dir_is_refused(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = {"pid": os.getpid(), "host": socket.gethostname(), "since": "now"}  # this test process: alive
    (run_dir / LOCK_FILE).write_text(json.dumps(lock))
    proc = run_in_process("train", *common_args(small_corpus), "--max_steps", "1", "--output_dir", run_dir)
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert f"is in use by a live run (pid {os.getpid()} on {socket.gethostname()}" in line
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]
    remember("a second run in a live run's dir", line.replace(str(os.getpid()), "PID")
             .replace(socket.gethostname(), "HOST").replace("since now", "since TIME"), tmp_path)


# --- under accelerate launch ----------------------------------------------------------------------

def launched_error(proc: subprocess.CompletedProcess) -> str:
    """Rank 0's line. (torchrun's launcher then adds its own report of the failed ranks and exits 1.)"""
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1, proc.stderr[-3000:]  # printed once, not once per rank
    assert not re.search(r"\[rank\d\]: Traceback", proc.stderr), proc.stderr[-3000:]  # no rank died with a traceback
    return errors[0][errors[0].index("error: "):]


@pytest.mark.slow
def test_too_little_data_for_one_batch_on_every_rank(tmp_path, env, small_corpus):
    text = small_corpus.read_text()[:2500]  # 5-6 blocks of 64 tokens: less than 2 ranks x 4
    (tmp_path / "small.txt").write_text(text)
    args = [*common_args(tmp_path / "small.txt"), "--validation_split", "0.3", "--max_steps", "2",
            "--output_dir", str(tmp_path / "out")]
    before = snapshot(tmp_path)
    line = launched_error(run_cli(["train", *args], env, mixed_precision="no"))
    assert "training samples are fewer than one batch on every rank (4 x 2)" in line
    assert snapshot(tmp_path) == before
    remember("too little data for one batch on every rank", line, tmp_path)


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(checkpointed_run, tmp_path, env):
    run_dir = tmp_path / "run"
    shutil.copytree(checkpointed_run, run_dir)
    before = snapshot(run_dir / "checkpoints")
    final_before = snapshot(run_dir / "final")
    proc = run_cli(["resume", str(run_dir), "--max_steps", "20", "--checkpoint_every", "1",
                    "--learning_rate", "1e6"], env, mixed_precision="no", warm=True)
    line = launched_error(proc)
    # Step 13 starts from the step-12 weights, so its loss is finite; its update blows up. The checkpoint of
    # step S - 1 holds the weights that made the NaN at step S, so step S - 2 is the one to go back to.
    nan_step = int(re.search(r"the loss is nan at step (\d+),", line).group(1))
    assert nan_step >= 14, line
    assert all(math.isfinite(r["loss"]) for r in train_rows(run_dir))
    assert [r["step"] for r in train_rows(run_dir)][-1] == nan_step - 1  # the bad step is not logged
    good = run_dir / "checkpoints" / f"step_{nan_step - 2:06d}"
    assert f"the newest checkpoint whose weights still gave a finite loss is {good}" in line
    assert f"--resume_from_checkpoint {good} --learning_rate 0.001`" in line  # a tenth of 1e6 would diverge too
    assert "learning rate schedule rescaled from a peak of 0.003 to 1e+06" in proc.stdout  # the override took effect
    # Checkpoints written after the resume (every step) stop before the bad step; nothing older changed.
    after = snapshot(run_dir / "checkpoints")
    assert {k: v for k, v in after.items() if k in before} == before
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == \
        ["step_000006", "step_000012"] + [f"step_{s:06d}" for s in range(13, nan_step)]
    assert snapshot(run_dir / "final") == final_before
    remember("NaN loss", line, tmp_path)


@pytest.mark.slow
def test_sigterm_to_every_process_of_the_launch_leaves_a_resumable_checkpoint(tmp_path, env, small_corpus):
    """As Ctrl-C in a terminal or Slurm's scancel deliver it: to the launcher and
    to each rank, which then gets it twice (the launcher passes its copy on)."""
    run_dir = tmp_path / "run"
    args = ["train", *common_args(small_corpus), "--max_steps", "400", "--checkpoint_every", "5",
            "--output_dir", str(run_dir)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "fsdp.yaml"),
           "--num_processes", "2", "--main_process_port", str(free_port()), "--mixed_precision", "no",
           "-m", "finetune", *args]
    launcher = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    deadline = time.time() + 120
    while not (run_dir / "checkpoints" / "step_000005").is_dir():  # mid-run, after a first checkpoint
        assert launcher.poll() is None and time.time() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.05)
    os.killpg(launcher.pid, signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)

    stopped = [line for line in err.splitlines() if "stopped: SIGTERM at step" in line]
    assert len(stopped) == 1, err[-3000:]
    step = int(re.search(r"at step (\d+)", stopped[0]).group(1))
    assert 5 <= step < 400
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints[-1] == f"step_{step:06d}" and not any(p.startswith(".tmp") for p in checkpoints)
    assert not (run_dir / "final").exists()

    # The command it printed, run verbatim in a new shell (no launcher), continues under FSDP on 2 processes.
    printed = re.search(r"continue with `(.+)`", stopped[0]).group(1)
    shell_env = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}
    check_ok(subprocess.run(["bash", "-c", f"{printed} --max_steps {step + 3}"], env=shell_env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300))
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, step + 4))  # every step logged once
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == step + 3
    remember("SIGTERM or Ctrl-C", stopped[0][stopped[0].index("stopped: "):], tmp_path)


# --- the troubleshooting page ----------------------------------------------------------------------------------

def test_the_troubleshooting_page_lists_every_message():
    """Runs last in this file: every message seen above, as the troubleshooting
    page shows it. FINETUNE_UPDATE_DOCS=1 rewrites the table instead."""
    if len(SEEN) < len(CASES) + 10:  # the table above and the ten tests after it
        pytest.skip("run the whole file to compare the troubleshooting page")
    text = TROUBLESHOOTING.read_text()
    start = text.index("<!-- troubleshooting:start -->")
    end = text.index("<!-- troubleshooting:end -->")
    rows = "".join(f"| {case} | {message.replace('|', '&#124;')} |\n" for case, message in sorted(SEEN.items()))
    section = "<!-- troubleshooting:start -->\n| situation | what finetune says |\n| --- | --- |\n" + rows
    if os.environ.get("FINETUNE_UPDATE_DOCS"):
        TROUBLESHOOTING.write_text(text[:start] + section + text[end:])
        return
    assert text[start:end] == section, "docs/troubleshooting.md is stale: FINETUNE_UPDATE_DOCS=1 bash scripts/test.sh tests/e2e/test_errors.py"


LAUNCHED_CASES = {  # case -> (arguments, the error's words, whether it needs no process group)
    "misspelt option": (lambda t: ["--max_step", "3"], "did you mean --max_steps?", True),
    "missing data file": (lambda t: ["--dataset", str(t / "none.txt")], "does not exist", True),
    "value out of range": (lambda t: ["--validation_split", "2"], "--validation_split must be between 0 and 1", True),
    "unknown config key": (lambda t: ["--config", str(_yaml(t, "learning_rte: 0.1\n"))], "unknown key 'learning_rte'",
                           True),
    "another run's output dir": (lambda t: ["--output_dir", str(_existing_run(t))], "already holds a run", True),
    "missing text column": (lambda t: ["--dataset", str(_jsonl_with_body(t))], "has no column 'text'", False),
}


def _yaml(tmp: Path, text: str) -> Path:
    (tmp / "run.yaml").write_text(text)
    return tmp / "run.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAUNCHED_CASES))
def test_bad_input_under_accelerate_launch_is_one_line_from_one_rank(case, tmp_path, env):
    """Every rank reaches the same verdict: our line once, no worker traceback,
    and what needs no process group fails about as fast as the launcher starts."""
    make_args, expected, early = LAUNCHED_CASES[case]
    args = make_args(tmp_path)
    if "--output_dir" not in args:
        args += ["--output_dir", str(tmp_path / "out")]
    start, cpu_start = time.perf_counter(), children_cpu_seconds()
    proc = run_cli(["train", *args, "--max_steps", "2"] if case != "misspelt option" else ["train", *args], env)
    seconds, cpu_seconds = time.perf_counter() - start, children_cpu_seconds() - cpu_start
    output = proc.stdout + proc.stderr
    ours = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and expected in ours[0], output[-3000:]
    package = str(REPO / "finetune")
    assert "[rank" not in output and package not in output, output[-3000:]  # no worker traceback
    assert proc.returncode != 0
    if early:
        # The launcher and both ranks, all of their CPU: the ranks end before torch loads (about 10 CPU-s each).
        assert cpu_seconds < 6, cpu_seconds
        assert seconds < 40, seconds  # a launch alone: ~5 s, up to ~15 s beside the suite's other worker


def children_cpu_seconds() -> float:
    """User and system CPU of every child process this one has waited for, and of their children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.slow
def test_size_based_wrap_of_a_transformer_is_one_line(tmp_path, env, small_corpus):
    """fsdp_cnn.yaml (the lectures' size-based wrap) with tiny-gpt2: refused
    before `prepare`, naming the config that shards it, on every rank."""
    proc = run_cli(["train", *common_args(small_corpus), "--max_steps", "2", "--output_dir", str(tmp_path / "run")],
                   env, config="fsdp_cnn.yaml")
    output = proc.stdout + proc.stderr
    ours = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "transformer.h (a ModuleList without forward)" in ours[0], output[-3000:]
    assert "--config_file $(finetune configs --path fsdp)" in ours[0] and "[rank" not in output
    assert not (tmp_path / "run").exists()
