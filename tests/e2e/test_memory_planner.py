"""`finetune estimate-memory`'s peak RSS per rank against real CPU runs: the
resident set each rank reached (`peak_memory_bytes_per_rank`, the kernel's
high-water mark), for tiny-gpt2, the GPT-2 124M shape and a Llama-style model
of 34 M parameters (grouped-query attention, untied), on 1, 2 and 3 processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import check_ok, run_cli
from sft_models import chat_tokenizer, conversations

pytestmark = pytest.mark.slow

TOLERANCE = 0.15


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """Large enough that its tensors, not the libraries, dominate the resident set."""
    path = tmp_path_factory.mktemp("llama34m")
    tokenizer = chat_tokenizer([m["content"] for row in conversations(200) for m in row["messages"]])
    config = LlamaConfig(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def predicted_peak_rss(model: str, num_processes: int, batch: int, block_size: int) -> int:
    from finetune.memory import estimate, model_shape

    rows = estimate(model_shape(model), num_processes, batch, block_size, mixed_precision="no", loss_chunk_size=512)
    return next(e for e in rows if e.strategy == "FSDP full shard").peak_rss


def assert_predicted(summary: dict, model: str, num_processes: int, batch: int, block_size: int) -> None:
    predicted = predicted_peak_rss(model, num_processes, batch, block_size)
    measured = summary["peak_memory_bytes_per_rank"]
    assert len(measured) == num_processes and summary["distributed_type"] == "FSDP"
    errors = [predicted / m - 1 for m in measured]
    assert all(abs(e) <= TOLERANCE for e in errors), (f"predicted {predicted:,} bytes per rank, measured {measured}: "
                                                      f"errors {[f'{e:+.1%}' for e in errors]}")


def test_tiny_gpt2_on_2_processes(checkpointed_run):
    """The shared 12-step run (fp32, 4 x 64 tokens per rank); test_resume checks
    tiny-gpt2's resumes on 1 and 3 processes the same way."""
    summary = json.loads((checkpointed_run / "summary.json").read_text())
    assert_predicted(summary, "tiny-gpt2", 2, batch=4, block_size=64)


@pytest.mark.parametrize("model,num_processes", [("llama", 1), ("llama", 3), ("gpt2-small", 2)])
def test_predicted_peak_rss_is_within_15_percent(model, num_processes, tmp_path, env, small_corpus, request):
    name = str(request.getfixturevalue("llama_dir")) if model == "llama" else model
    run_dir = tmp_path / "run"
    # Two steps reach the plateau: the optimizer state and the heap's high-water mark come with the first two.
    check_ok(run_cli(["train", "--model", name, "--dataset", str(small_corpus), "--block_size", "128",
                      "--per_device_batch_size", "2", "--max_steps", "2", "--sample_prompt", "", "--max_eval_batches", "1",
                      "--output_dir", str(run_dir)], env, nproc=num_processes, mixed_precision="no"))
    assert_predicted(json.loads((run_dir / "summary.json").read_text()), name, num_processes, batch=2, block_size=128)
