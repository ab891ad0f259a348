"""Every kind of file the tool reads, damaged: a valid example of each kind,
truncated, bit-flipped, wrong-typed, made non-UTF-8, emptied and oversized,
fed to the command that reads it. A damage that leaves the file valid may run;
any other ends in exit 2 with one line naming the problem, no traceback, and
nothing written or left behind. Seeded, one command per case."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Callable

import pytest

from conftest import CONFIGS, run_in_process
from sft_models import CHATML, conversations, save_chat_model, save_gguf_model, write_jsonl
from e2e.test_errors import snapshot

SEED = 20261125
MUTATIONS = ("truncated", "bit-flipped", "wrong-typed", "non-utf8", "empty", "oversized")


def mutate(path: Path, how: str, rng: random.Random) -> None:
    data = path.read_bytes()
    if how == "truncated":
        data = data[: max(1, len(data) // 2)]
    elif how == "bit-flipped":
        data = bytearray(data)
        for _ in range(4):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        data = bytes(data)
    elif how == "wrong-typed":
        data = b'[1, "two", {"three": null}]\n' if path.suffix in (".json", ".jsonl", ".yaml") else b"\x00" * 64
    elif how == "non-utf8":
        i = rng.randrange(len(data))
        data = data[:i] + b"\xff\xfe" + data[i:]
    elif how == "empty":
        data = b""
    elif how == "oversized":
        data = data + rng.randbytes(1 << 20)
    path.write_bytes(data)


@pytest.fixture(scope="module")
def examples(tmp_path_factory, checkpointed_run) -> dict[str, Path]:
    """A valid file of each kind, in a dir that each case copies."""
    root = tmp_path_factory.mktemp("valid")
    model = save_chat_model(root / "model")
    save_gguf_model(root / "model.gguf")
    write_jsonl(root / "chat.jsonl", conversations(24, seed=1))
    (root / "template.jinja").write_text(CHATML)
    shutil.copy(CONFIGS / "zero2.yaml", root / "accelerate.yaml")
    shutil.copy(CONFIGS / "zero2.json", root / "zero2.json")
    shutil.copytree(checkpointed_run, root / "run")
    return {"root": root, "model": model}


# kind -> (the file under the valid examples' root, the command that reads it, given that root)
TRAIN = ["train", "--max_steps", "1", "--block_size", "64", "--per_device_batch_size", "2", "--max_eval_batches", "1",
         "--sample_prompt", ""]
KINDS: dict[str, tuple[str, Callable[[Path], list]]] = {
    "data file": ("chat.jsonl", lambda r: [*TRAIN, "--model", r / "model", "--dataset", r / "chat.jsonl",
                                           "--output_dir", r / "out"]),
    "chat template": ("template.jinja", lambda r: [*TRAIN, "--model", r / "model", "--dataset", r / "chat.jsonl",
                                                   "--chat_template", r / "template.jinja", "--output_dir", r / "out"]),
    "model config": ("model/config.json", lambda r: ["generate", r / "model", "--prompt", "Hi", "--max_new_tokens", "2"]),
    "tokenizer": ("model/tokenizer.json", lambda r: ["generate", r / "model", "--prompt", "Hi", "--max_new_tokens", "2"]),
    "weights": ("model/model.safetensors", lambda r: ["generate", r / "model", "--prompt", "Hi", "--max_new_tokens", "2"]),
    "model config, GGUF export": ("model/config.json", lambda r: ["export", r / "model", "--format", "gguf",
                                                                 "--output", r / "out.gguf"]),
    "tokenizer, GGUF export": ("model/tokenizer.json", lambda r: ["export", r / "model", "--format", "gguf",
                                                                  "--output", r / "out.gguf"]),
    "weights, GGUF export": ("model/model.safetensors", lambda r: ["export", r / "model", "--format", "gguf",
                                                                   "--output", r / "out.gguf"]),
    "weights, benchmark": ("model/model.safetensors", lambda r: ["evaluate", r / "model", "--tasks",
                                                                 "finetune_stdlib_qa", "--limit", "2"]),
    "GGUF model": ("model.gguf", lambda r: ["generate", r / "model.gguf", "--prompt", "Hi", "--max_new_tokens", "2"]),
    "GGUF model, planned": ("model.gguf", lambda r: ["estimate-memory", "--model", r / "model.gguf",
                                                     "--num_processes", "2"]),
    "accelerate config": ("accelerate.yaml", lambda r: ["estimate-memory", "--model", "tiny-gpt2",
                                                        "--accelerate_config", r / "accelerate.yaml"]),
    "run record": ("run/run_config.yaml", lambda r: ["resume", r / "run", "--no_relaunch"]),
    "checkpoint progress": ("run/checkpoints/step_000012/training_progress.json",
                            lambda r: ["export", r / "run", "--output", r / "out"]),
    "checkpoint metadata": ("run/checkpoints/step_000012/pytorch_model_fsdp_0/.metadata",
                            lambda r: ["export", r / "run", "--output", r / "out"]),
    "checkpoint manifest": ("run/checkpoints/step_000012/manifest.json",
                            lambda r: ["export", r / "run", "--output", r / "out"]),
}


@pytest.mark.parametrize("how", MUTATIONS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_damaged_file_is_one_line_or_harmless(kind, how, examples, tmp_path):
    rng = random.Random(f"{SEED}-{kind}-{how}")
    root = tmp_path / "case"
    shutil.copytree(examples["root"], root, symlinks=True)
    name, command = KINDS[kind]
    mutate(root / name, how, rng)
    before = snapshot(root)
    proc = run_in_process(*command(root))
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if proc.returncode == 0:  # the damage left a valid file (a flipped letter in a text): it ran
        return
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and sum("error" in line.lower() for line in lines) == 1, \
        proc.stderr[-2000:]
    assert snapshot(root) == before, "a failed command wrote or left something behind"


@pytest.mark.parametrize("seed", range(6))
def test_a_gguf_with_damaged_metadata_is_one_line_or_harmless(seed, examples, tmp_path):
    """Bit flips in the header and key-value section (the tokenizer, the shapes and
    the offsets the reader trusts), where the whole-file flips above mostly land
    in the tensor data."""
    import gguf

    valid = examples["root"] / "model.gguf"
    data, rng = bytearray(valid.read_bytes()), random.Random(f"{SEED}-gguf-{seed}")
    metadata_end = gguf.GGUFReader(str(valid)).data_offset
    for _ in range(4):
        data[rng.randrange(24, metadata_end)] ^= 1 << rng.randrange(8)
    damaged = tmp_path / "model.gguf"
    damaged.write_bytes(bytes(data))
    before = snapshot(tmp_path)
    proc = run_in_process("generate", damaged, "--prompt", "Hi", "--max_new_tokens", "2")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if proc.returncode != 0:
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: "), proc.stderr[-2000:]
    assert snapshot(tmp_path) == before
