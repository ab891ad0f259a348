"""End-to-end FSDP fine-tuning through `accelerate launch`, checked from the outside."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, pipeline

from conftest import check_ok, common_args, dcp_elements_per_file, eval_rows, launches, run_cli, run_in_process, train_rows

pytestmark = pytest.mark.slow


BUILTIN_20_STEPS = ["train", "--model", "tiny-gpt2", "--dataset", "builtin", "--max_steps", "20",
                    "--learning_rate", "3e-3", "--eval_every", "10"]
# bf16 against fp32 over the 20 steps above: largest per-step difference of the
# logged (fp32-computed) loss, and of the final validation loss, in nats/token.
BF16_LOSS_TOLERANCE = 0.05


@pytest.fixture(scope="module")
@launches
def fsdp_run(tmp_path_factory, env) -> Path:
    """2-process FSDP (bf16, as fsdp.yaml says) on the built-in corpus for 20 steps."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    proc = run_cli([*BUILTIN_20_STEPS, "--output_dir", str(run_dir)], env, warm=True)
    check_ok(proc)
    assert "final model:" in proc.stdout and "fine-tuned model's sample, from the prompt 'The': '" in proc.stdout
    return run_dir


def test_bf16_loss_curve_stays_close_to_fp32(fsdp_run, tmp_path, env):
    fp32_dir = tmp_path / "fp32"
    check_ok(run_cli([*BUILTIN_20_STEPS, "--sample_prompt", "", "--output_dir", str(fp32_dir)], env,
                     mixed_precision="no", warm=True))
    bf16, fp32 = train_rows(fsdp_run), train_rows(fp32_dir)
    assert json.loads((fp32_dir / "summary.json").read_text())["mixed_precision"] == "no"
    differences = [abs(a["loss"] - b["loss"]) for a, b in zip(bf16, fp32)]
    assert len(differences) == 20 and max(differences) < BF16_LOSS_TOLERANCE, differences
    assert max(differences) > 0, "bf16 and fp32 gave identical losses: was bf16 really on?"
    assert abs(eval_rows(fsdp_run)[-1]["eval_loss"] - eval_rows(fp32_dir)[-1]["eval_loss"]) < BF16_LOSS_TOLERANCE


def test_bf16_keeps_fp32_master_weights_and_optimizer_state(fsdp_run):
    checkpoint = fsdp_run / "checkpoints" / "step_000020"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        metadata = FileSystemReader(str(checkpoint / part)).read_metadata()
        dtypes = {fqn: meta.properties.dtype for fqn, meta in metadata.state_dict_metadata.items()
                  if hasattr(meta, "properties") and meta.properties.dtype.is_floating_point}
        assert dtypes and set(dtypes.values()) == {torch.float32}, (part, set(dtypes.values()))
    assert any("exp_avg_sq" in fqn for fqn in dtypes)


def test_summary_reports_real_fsdp_shards(fsdp_run):
    summary = json.loads((fsdp_run / "summary.json").read_text())
    assert summary["distributed_type"] == "FSDP"
    assert summary["world_size"] == 2
    assert summary["fsdp_version"] == 2
    assert summary["mixed_precision"] == "bf16"
    total, local = summary["total_params"], summary["local_params_per_rank"]
    assert len(local) == 2 and sum(local) == total
    for n in local:
        assert abs(n - total / 2) <= 0.01 * total, local
    assert summary["steps"] == 20
    assert len(summary["peak_memory_bytes_per_rank"]) == 2
    # fp32 params, grads and both AdamW moments of the local shard only, even under bf16.
    assert summary["state_bytes_per_rank"] == [16 * n for n in local]


def test_checkpoint_holds_one_shard_file_per_rank_matching_summary(fsdp_run):
    summary = json.loads((fsdp_run / "summary.json").read_text())
    shard_dir = fsdp_run / "checkpoints" / "step_000020" / "pytorch_model_fsdp_0"
    files = sorted(p.name for p in shard_dir.glob("*.distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]
    # GPT-2 ties lm_head.weight to wte.weight; DCP stores the tied name separately.
    per_file = dcp_elements_per_file(shard_dir, skip={"model.lm_head.weight"})
    assert [per_file[f] for f in files] == summary["local_params_per_rank"]
    assert sum(per_file.values()) == summary["total_params"]


def test_validation_loss_goes_down(fsdp_run):
    evals = eval_rows(fsdp_run)
    assert [r["step"] for r in evals] == [0, 10, 20]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.3
    assert math.isclose(evals[-1]["perplexity"], math.exp(evals[-1]["eval_loss"]), rel_tol=1e-9)
    rows = train_rows(fsdp_run)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert {"epoch", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_sec"} <= rows[0].keys()
    assert rows[0]["lr"] == 0.0 < rows[1]["lr"]  # transformers' linear warmup starts from 0


def test_run_dir_layout(fsdp_run):
    for name in ["run_config.yaml", "metrics.jsonl", "summary.json", "loss.png", "final/config.json",
                 "final/model.safetensors", "final/tokenizer.json", "final/generation_config.json"]:
        assert (fsdp_run / name).is_file(), name
    assert not list((fsdp_run / "checkpoints").glob(".tmp-*"))


def test_final_model_equals_the_trained_state(fsdp_run, tmp_path):
    final = AutoModelForCausalLM.from_pretrained(fsdp_run / "final").eval()
    assert final.lm_head.weight.data_ptr() == final.transformer.wte.weight.data_ptr(), "tied embeddings were untied"

    # The trained state, read independently from the step-20 DCP shards.
    dcp_to_torch_save(fsdp_run / "checkpoints" / "step_000020" / "pytorch_model_fsdp_0", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    reference = GPT2LMHeadModel(AutoConfig.from_pretrained(fsdp_run / "final")).eval()
    loaded = reference.load_state_dict(full, strict=False)
    assert loaded.missing_keys == ["lm_head.weight"] and not loaded.unexpected_keys  # the tied weight, stored once

    ids = torch.randint(0, final.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(final(ids).logits, reference(ids).logits)


def test_final_model_generates_text(fsdp_run):
    generator = pipeline("text-generation", model=str(fsdp_run / "final"), device="cpu")
    out = generator("Return the", max_new_tokens=8, do_sample=False)
    assert out[0]["generated_text"].startswith("Return the") and len(out[0]["generated_text"]) > len("Return the")


def test_two_rank_fsdp_matches_one_process(tmp_path, env, small_corpus):
    """fp32: 2 ranks x 4 sequences and 1 process x 8 sequences take the same steps."""
    common = ["train", "--model", "tiny-gpt2", "--dataset", str(small_corpus), "--max_steps", "5",
              "--block_size", "64", "--sample_prompt", "", "--max_eval_batches", "1"]
    two = run_cli(common + ["--per_device_batch_size", "4", "--output_dir", str(tmp_path / "two")], env,
                  mixed_precision="no", warm=True)
    check_ok(two)
    one = run_in_process(*common, "--per_device_batch_size", "8", "--output_dir", tmp_path / "one")  # unlaunched
    check_ok(one)
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["distributed_type"] == "FSDP"
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["distributed_type"] == "NO"
    two_rows, one_rows = train_rows(tmp_path / "two"), train_rows(tmp_path / "one")
    assert len(two_rows) == len(one_rows) == 5
    for a, b in zip(two_rows, one_rows):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
    assert two_rows[-1]["loss"] < two_rows[0]["loss"]


def _tiny_pretrained(path: Path, corpus: Path) -> GPT2LMHeadModel:
    from finetune.data.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer([corpus.read_text()], vocab_size=512)
    torch.manual_seed(123)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=512,
                                       bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def test_fine_tuning_starts_from_the_pretrained_weights(tmp_path, env, small_corpus):
    model_dir = tmp_path / "pretrained"
    model = _tiny_pretrained(model_dir, small_corpus).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    # Training text of exactly one global batch (2 ranks x 4 blocks of 32): the
    # first step sees every block, so its loss does not depend on the order.
    block, n_blocks = 32, 8
    lines, stream = [], []
    for line in small_corpus.read_text().split("\n\n"):  # a paragraph per document
        ids = tokenizer(line)["input_ids"] + [tokenizer.eos_token_id]
        if len(stream) + len(ids) >= (n_blocks + 1) * block:
            continue
        lines.append(line)
        stream += ids
        if len(stream) >= n_blocks * block:
            break
    assert n_blocks * block <= len(stream) < (n_blocks + 1) * block
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text("\n\n".join(lines) + "\n")
    (data / "validation.txt").write_text("\n\n".join(small_corpus.read_text().split("\n\n")[-40:]))

    blocks = torch.tensor(stream[: n_blocks * block]).view(n_blocks, block)
    with torch.no_grad():
        expected = model(input_ids=blocks, labels=blocks).loss.item()

    proc = run_cli(["train", "--model", str(model_dir), "--dataset", str(data), "--block_size", str(block),
                    "--per_device_batch_size", "4", "--max_steps", "2", "--sample_prompt", "",
                    "--output_dir", str(tmp_path / "run")], env, mixed_precision="no", warm=True)
    check_ok(proc)
    first = train_rows(tmp_path / "run")[0]
    assert first["loss"] == pytest.approx(expected, abs=1e-5)
    assert (tmp_path / "run" / "final" / "tokenizer.json").is_file()


def test_summary_md_says_how_the_run_went(fsdp_run):
    facts = json.loads((fsdp_run / "summary.json").read_text())
    text = (fsdp_run / "summary.md").read_text()
    assert "FSDP on 2 process(es), FSDP2 with" in text
    assert ", ".join(f"{n:,}" for n in facts["local_params_per_rank"]) in text
    first, last = facts["first_eval"]["perplexity"], facts["last_eval"]["perplexity"]
    assert f"Validation perplexity: {first:.4f} -> {last:.4f}" in text
    assert text.count(f"{facts['last_eval']['eval_loss']:.4f})") == 1  # the loss once, not repeated after the line
    assert facts["final_model_dir"] in text


def test_report_to_none_keeps_the_summaries_only(tmp_path, small_corpus):
    """One process, unlaunched, in this process."""
    run_dir = tmp_path / "run"
    proc = run_in_process("train", *common_args(small_corpus), "--max_steps", "2", "--report_to", "none",
                          "--output_dir", run_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run_dir / "summary.json").is_file() and (run_dir / "summary.md").is_file()
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "loss.png").exists()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
