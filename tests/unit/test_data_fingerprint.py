"""Unit tests of what a resume compares with what its checkpoint read
(finetune/data/fingerprint.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.data.fingerprint import STREAMED_BYTES_READ, check_same_inputs, input_fingerprints
from finetune.errors import UsageError


def options(dataset: Path, streaming: bool) -> SimpleNamespace:
    return SimpleNamespace(dataset=str(dataset), chat_template="", streaming=streaming, reference_model="")


def large_file(path: Path) -> Path:
    line = b'{"text": "a line of a corpus larger than what is read of it"}\n'
    path.write_bytes(line * (3 * STREAMED_BYTES_READ // len(line)))
    return path


def edit_middle(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"A")


def test_a_streamed_file_edited_between_its_ends_is_refused(tmp_path):
    data = large_file(tmp_path / "corpus.jsonl")
    cfg = options(data, streaming=True)
    recorded = input_fingerprints(cfg)
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))  # the edit's own time
    edit_middle(data)
    with pytest.raises(UsageError, match=f"--dataset {data} was modified since ckpt was written"):
        check_same_inputs(recorded, input_fingerprints(cfg), cfg, Path("ckpt"))


def test_a_streamed_copy_with_another_time_resumes_after_the_touch_the_message_gives(tmp_path):
    data = large_file(tmp_path / "corpus.jsonl")
    cfg = options(data, streaming=True)
    recorded = input_fingerprints(cfg)
    copy = tmp_path / "copy.jsonl"
    shutil.copyfile(data, copy)
    copy.replace(data)  # the same bytes, written now
    os.utime(data, ns=(data.stat().st_atime_ns, recorded["dataset"]["times_ns"][str(data)] + 10**9))
    with pytest.raises(UsageError) as refused:
        check_same_inputs(recorded, input_fingerprints(cfg), cfg, Path("ckpt"))
    touch = re.search(r"`(touch -d @\S+ \S+)`", str(refused.value)).group(1)
    subprocess.run(touch.split(), check=True)
    check_same_inputs(recorded, input_fingerprints(cfg), cfg, Path("ckpt"))  # accepted


def test_a_file_read_whole_is_compared_by_content_alone(tmp_path):
    data = large_file(tmp_path / "corpus.jsonl")
    cfg = options(data, streaming=False)
    recorded = input_fingerprints(cfg)
    os.utime(data, ns=(0, 10**9))
    check_same_inputs(recorded, input_fingerprints(cfg), cfg, Path("ckpt"))  # touched: the same content
    edit_middle(data)
    with pytest.raises(UsageError, match="changed since ckpt was written \\(the same size, other content\\)"):
        check_same_inputs(recorded, input_fingerprints(cfg), cfg, Path("ckpt"))


def test_a_streamed_checkpoint_recorded_without_times_still_resumes(tmp_path):
    data = large_file(tmp_path / "corpus.jsonl")
    cfg = options(data, streaming=True)
    now = input_fingerprints(cfg)
    older = {"dataset": {k: v for k, v in now["dataset"].items() if k not in ("times_ns", "content_sha256")}
                        | {"sha256": now["dataset"]["content_sha256"]}}
    check_same_inputs(older, now, cfg, Path("ckpt"))


def test_a_frozen_reference_moved_whole_is_the_same_and_other_weights_are_refused(tmp_path):
    import torch
    from safetensors.torch import save_file

    reference = tmp_path / "reference"
    reference.mkdir()
    save_file({"w": torch.arange(8.0)}, str(reference / "model.safetensors"))
    (reference / "config.json").write_text('{"model_type": "gpt2"}')
    cfg = SimpleNamespace(dataset="", chat_template="", streaming=False, reference_model="", model=str(reference))
    recorded = input_fingerprints(cfg, reference=str(reference))
    moved = tmp_path / "moved"
    shutil.copytree(reference, moved)
    cfg.model = str(moved)
    check_same_inputs(recorded, input_fingerprints(cfg, reference=str(moved)), cfg, Path("ckpt"))
    save_file({"w": torch.arange(8.0) + 1}, str(moved / "model.safetensors"))
    with pytest.raises(UsageError, match=f"--model {moved} is not the reference ckpt was trained against "
                                         f"\\({reference}, as it was then\\)"):
        check_same_inputs(recorded, input_fingerprints(cfg, reference=str(moved)), cfg, Path("ckpt"))
    assert input_fingerprints(cfg, reference="tiny-gpt2") != input_fingerprints(cfg, reference="small-gpt2")


def test_a_reward_models_other_weights_stop_the_resume_and_a_reward_files_edit_does(tmp_path):
    import torch
    from safetensors.torch import save_file

    model, code = tmp_path / "reward-model", tmp_path / "rewards.py"
    model.mkdir()
    save_file({"score.weight": torch.arange(8.0)}, str(model / "model.safetensors"))
    (model / "config.json").write_text('{"model_type": "llama"}')
    code.write_text("def correct(completions, **columns):\n    return [1.0] * len(completions)\n")
    cfg = SimpleNamespace(dataset="", chat_template="", streaming=False, reference_model="",
                          reward_funcs=[str(model), f"{code}:correct", "exact_match"])
    recorded = input_fingerprints(cfg)
    assert set(recorded["reward_funcs"]) == {str(model), f"{code}:correct"}  # a built-in is the package's
    (model / "README.md").write_text("notes")  # not weights
    check_same_inputs(recorded, input_fingerprints(cfg), cfg, Path("ckpt"))
    save_file({"score.weight": torch.arange(8.0) + 1}, str(model / "model.safetensors"))
    with pytest.raises(UsageError, match=f"the reward model {model} changed since ckpt was written"):
        check_same_inputs(recorded, input_fingerprints(cfg), cfg, Path("ckpt"))
    recorded = input_fingerprints(cfg)
    code.write_text(code.read_text().replace("1.0", "2.0"))
    with pytest.raises(UsageError, match=f"the reward file {code} changed since ckpt was written"):
        check_same_inputs(recorded, input_fingerprints(cfg), cfg, Path("ckpt"))
