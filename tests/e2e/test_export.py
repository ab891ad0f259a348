"""`finetune export`, `generate` and `evaluate` on real checkpoints, in one process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

from conftest import check_ok, common_args, eval_rows, run_cli, run_in_process, train_rows

pytestmark = pytest.mark.slow


def finetune(*args, env=None) -> subprocess.CompletedProcess:
    return run_in_process(*args)


def logits(model, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.eval()(ids).logits


@pytest.fixture(scope="module")
def exported(checkpointed_run, tmp_path_factory, env) -> Path:
    out = tmp_path_factory.mktemp("export") / "step6"
    check_ok(finetune("export", checkpointed_run / "checkpoints" / "step_000006", "--output", out, env=env))
    return out


def test_export_equals_the_checkpointed_state_and_stays_tied(exported, checkpointed_run, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    dcp_to_torch_save(checkpointed_run / "checkpoints" / "step_000006" / "pytorch_model_fsdp_0", tmp_path / "s.pt")
    reference = GPT2LMHeadModel(AutoConfig.from_pretrained(exported))
    loaded = reference.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True)["model"], strict=False)
    assert loaded.missing_keys == ["lm_head.weight"] and not loaded.unexpected_keys  # the tied weight, stored once
    assert torch.equal(logits(model, model.config.vocab_size), logits(reference, model.config.vocab_size))
    for name in ["config.json", "generation_config.json", "tokenizer.json", "model.safetensors"]:
        assert (exported / name).is_file()


def test_every_model_dir_carries_a_model_card_of_its_step(exported, checkpointed_run, tmp_path):
    """final/ and an export of the run's last checkpoint: the run's facts and
    its last evaluation; an export of an earlier step: that step, and no
    evaluation it did not have. The Hub's own parser reads the header."""
    from huggingface_hub import ModelCard

    summary = json.loads((checkpointed_run / "summary.json").read_text())
    check_ok(finetune("export", checkpointed_run, "--output", tmp_path / "last"))
    for model_dir in (checkpointed_run / "final", tmp_path / "last"):
        card = ModelCard.load(model_dir / "README.md")
        assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
        assert {"finetune", "sft"} <= set(card.data.tags) and card.data.base_model is None  # a preset: from scratch
        assert f"{summary['last_eval']['perplexity']:.4f}" in card.text
        assert f"| Steps | {summary['steps']} of 8 sequences" in card.text and "tiny-gpt2" in card.text
        assert f"on {summary['device_name']}" in card.text and "FSDP2" in card.text
        assert (model_dir / "loss.png").read_bytes() == (checkpointed_run / "loss.png").read_bytes()
        assert f'AutoModelForCausalLM.from_pretrained("{model_dir}")' in card.text
    early = ModelCard.load(exported / "README.md").text
    assert "| Steps | 6 of 8 sequences" in early and "Not evaluated at step 6" in early
    assert f"{summary['last_eval']['perplexity']:.4f}" not in early and not (exported / "loss.png").exists()


def test_the_card_names_a_hub_base_and_the_license_a_local_base_states(tmp_path):
    from transformers import GPT2Config

    from finetune.model_card import RunRecord, model_card

    local = tmp_path / "base"
    local.mkdir()
    (local / "README.md").write_text("---\nlicense: mit\n---\n# a base\n")
    config = GPT2Config(n_layer=1)
    options = {"dataset": "org/some-data", "method": "dpo", "peft": "lora", "lora_r": 4}
    card = model_card(tmp_path / "out", config, RunRecord({**options, "model": str(local)}, {}))
    header = card.split("---")[1]
    assert "license: mit" in header and "base_model" not in header and "- org/some-data" in header
    assert "- lora" in header and "- dpo" in header
    card = model_card(tmp_path / "out", config, RunRecord({**options, "model": "org/base-model"}, {}))
    assert "base_model: org/base-model" in card and "license" not in card.split("---")[1]


def test_export_of_a_run_dir_takes_the_newest_checkpoint_and_matches_final(checkpointed_run, tmp_path, env):
    check_ok(finetune("export", checkpointed_run, "--output", tmp_path / "latest", env=env))
    ours = load_file(tmp_path / "latest" / "model.safetensors")
    final = load_file(checkpointed_run / "final" / "model.safetensors")
    assert ours.keys() == final.keys()
    for name in ours:  # step 12 consolidated offline == consolidated by the 2 ranks at the end
        assert torch.equal(ours[name], final[name]), name


def test_export_agrees_with_accelerate_merge_weights(checkpointed_run, exported, tmp_path, env):
    shards = checkpointed_run / "checkpoints" / "step_000006" / "pytorch_model_fsdp_0"
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "merge-weights", str(shards),
                           str(tmp_path / "merged")], capture_output=True, text=True, env=env, timeout=300)
    check_ok(proc)
    theirs = load_file(tmp_path / "merged" / "model.safetensors")
    ours = load_file(exported / "model.safetensors")
    assert set(theirs) - set(ours) <= {"lm_head.weight"}  # we store the tied weight once
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_bf16_export_is_half_the_size_and_close(checkpointed_run, exported, tmp_path, env):
    check_ok(finetune("export", checkpointed_run / "checkpoints" / "step_000006", "--output", tmp_path / "bf16",
                      "--dtype", "bfloat16", env=env))
    ratio = (tmp_path / "bf16" / "model.safetensors").stat().st_size / (exported / "model.safetensors").stat().st_size
    assert 0.45 < ratio < 0.55
    fp32 = AutoModelForCausalLM.from_pretrained(exported)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    a, b = logits(fp32, fp32.config.vocab_size), logits(bf16, fp32.config.vocab_size)
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_fine_tuning_from_an_export_starts_at_its_loss(checkpointed_run, tmp_path, env, small_corpus):
    """The export of step 12 scores the validation split as the run did at its end."""
    check_ok(finetune("export", checkpointed_run, "--output", tmp_path / "model", env=env))
    args = [a for a in common_args(small_corpus)]
    args[args.index("--model") + 1] = str(tmp_path / "model")
    check_ok(run_cli(["train", *args, "--max_steps", "2", "--output_dir", str(tmp_path / "second")], env,
                     mixed_precision="no", warm=True))
    end_of_first = eval_rows(checkpointed_run)[-1]
    start_of_second = eval_rows(tmp_path / "second")[0]
    assert start_of_second["step"] == 0 and end_of_first["step"] == 12
    assert start_of_second["eval_loss"] == pytest.approx(end_of_first["eval_loss"], abs=1e-5)
    assert len(train_rows(tmp_path / "second")) == 2


def test_generate_and_evaluate_use_the_export(exported, env, small_corpus, checkpointed_run, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    gen = finetune("generate", exported, "--prompt", "Return the", "--max_new_tokens", "5", env=env)
    check_ok(gen)
    assert gen.stdout.startswith("Return the")
    cores = len(os.sched_getaffinity(0))
    assert f"used {cores} CPU thread(s) ({cores} cores / 1 process(es) here" in gen.stderr
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "used 1 CPU thread(s) (OMP_NUM_THREADS)" in finetune("generate", exported, "--prompt", "The").stderr
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(cores)  # this process runs the tests that follow

    # With no options: the data, block size and rows the run's last evaluation scored (recorded with the model).
    plain = finetune("evaluate", checkpointed_run / "final")
    check_ok(plain)
    assert "the run's held-out data (the first 8 rows, as its evaluations scored); block size 64 (the run's)" in plain.stdout
    last_eval = eval_rows(checkpointed_run)[-1]
    assert last_eval["step"] == 12
    assert json.loads(plain.stdout.strip().splitlines()[-1])["perplexity"] == pytest.approx(last_eval["perplexity"],
                                                                                             rel=1e-5)
    ev = finetune("evaluate", exported, "--dataset", small_corpus, "--block_size", "64", env=env)
    check_ok(ev)
    result = json.loads(ev.stdout.strip().splitlines()[-1])

    # Independently: every paragraph a document ending in the end-of-text token, the
    # stream cut into 64-token blocks, each block scored by the model's own loss.
    tokenizer = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    lines = [line.strip("\n") for line in small_corpus.read_text().split("\n\n") if line.strip()]
    stream = [t for line in lines for t in tokenizer(line)["input_ids"] + [tokenizer.eos_token_id]]
    blocks = torch.tensor(stream[: len(stream) // 64 * 64]).view(-1, 64)
    with torch.no_grad():
        nll = sum(float(model(input_ids=blocks[i:i + 16], labels=blocks[i:i + 16]).loss) * len(blocks[i:i + 16]) * 63
                  for i in range(0, len(blocks), 16))
    assert result["rows"] == len(blocks) and result["num_tokens"] == len(blocks) * 63
    assert result["perplexity"] == pytest.approx(math.exp(nll / (len(blocks) * 63)), rel=1e-5)
    assert f"scored {len(lines):,} documents ({len(blocks):,} rows, {len(blocks) * 63:,} tokens)" in ev.stdout


def _bad(tmp_path: Path, checkpointed_run: Path, case: str) -> tuple[list, Path]:
    source = checkpointed_run / "checkpoints" / "step_000006"
    if case == "no checkpoint":
        (tmp_path / "empty").mkdir()
        return [tmp_path / "empty", "--output", tmp_path / "out"], tmp_path / "out"
    if case in ("missing shard", "truncated shard"):
        import shutil

        broken = tmp_path / "broken"
        shutil.copytree(source, broken)
        shard = broken / "pytorch_model_fsdp_0" / "__1_0.distcp"
        shard.unlink() if case == "missing shard" else shard.write_bytes(shard.read_bytes()[:100])
        return [broken, "--output", tmp_path / "out"], tmp_path / "out"
    if case == "non-empty output":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "mine.txt").write_text("keep")
        return [source, "--output", tmp_path / "out"], tmp_path / "out"
    if case == "unwritable output":
        (tmp_path / "afile").write_text("x")
        return [source, "--output", tmp_path / "afile" / "out"], tmp_path / "afile"
    raise ValueError(case)


@pytest.mark.parametrize("case, message", [
    ("no checkpoint", "holds no checkpoint"),
    ("missing shard", "__1_0.distcp is missing"),
    ("truncated shard", "__1_0.distcp is truncated"),
    ("non-empty output", "exists and is not empty; pass --overwrite"),
    ("unwritable output", "is not in a writable directory"),
])
def test_bad_export_input_is_one_line_and_leaves_the_output_alone(checkpointed_run, tmp_path, env, case, message):
    args, target = _bad(tmp_path, checkpointed_run, case)
    before = sorted((p.name, p.read_bytes() if p.is_file() else b"") for p in [target, *target.rglob("*")]
                    if p.exists())
    proc = finetune("export", *args, env=env)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr
    after = sorted((p.name, p.read_bytes() if p.is_file() else b"") for p in [target, *target.rglob("*")]
                   if p.exists())
    assert before == after
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_plain_accelerate_checkpoint_exports_with_model(checkpointed_run, exported, tmp_path, env):
    """Our checkpoint minus our own files is exactly what accelerator.save_state writes."""
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(checkpointed_run / "checkpoints" / "step_000006", plain,
                    ignore=shutil.ignore_patterns("training_progress.json", "run_config.yaml", "model_config",
                                                   "manifest.json"))
    unverified = finetune("export", plain, "--output", tmp_path / "out", env=env)
    assert unverified.returncode == 2 and "pass --allow_unverified_checkpoint" in unverified.stderr
    refused = finetune("export", plain, "--output", tmp_path / "out", "--allow_unverified_checkpoint", env=env)
    assert refused.returncode == 2 and "pass --model" in refused.stderr
    check_ok(finetune("export", plain, "--output", tmp_path / "out", "--model", checkpointed_run / "final",
                      "--allow_unverified_checkpoint", env=env))
    ours, plain_export = load_file(exported / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert ours.keys() == plain_export.keys()
    assert all(torch.equal(ours[k], plain_export[k]) for k in ours)


def test_export_streams_a_large_checkpoint_one_file_at_a_time(exported, checkpointed_run, tmp_path, env):
    """A 126 MB model in files of at most 24 MB: the export's peak RSS stays
    below its baseline (the RSS once a small export has run) plus twice the
    file size, and every tensor equals the checkpointed one. Export and
    generate, whose start-up is imports, import no data, plotting or optional
    libraries, and export no model code."""
    import shutil

    import torch.distributed.checkpoint as dcp

    config = AutoConfig.from_pretrained(exported)
    config.update(dict(n_layer=10, n_embd=512, n_head=8, n_positions=128))
    torch.manual_seed(0)
    state = {name: tensor for name, tensor in GPT2LMHeadModel(config).state_dict().items() if name != "lm_head.weight"}
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    shard = 24 * 10**6
    assert model_bytes >= 4 * shard and max(t.numel() * 4 for t in state.values()) < shard
    checkpoint = tmp_path / "big" / "checkpoints" / "step_000001"
    dcp.save({"model": state}, checkpoint_id=str(checkpoint / "pytorch_model_fsdp_0"), no_dist=True)
    shutil.copytree(exported, tmp_path / "model_files", ignore=shutil.ignore_patterns("*.safetensors*"))
    config.save_pretrained(tmp_path / "model_files")

    script = f"""
import sys
from pathlib import Path
from finetune.cli import main

def status(field):  # bytes
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

assert main(["export", {str(checkpointed_run)!r}, "--output", {str(tmp_path / "small")!r}]) == 0  # imports, warm paths
assert "transformers.modeling_utils" not in sys.modules  # the checkpoint says which weights are tied: no model code
assert main(["generate", {str(exported)!r}, "--prompt", "The", "--max_new_tokens", "2"]) == 0
heavy = ("datasets", "matplotlib", "evaluate", "tensorboard", "peft", "deepspeed", "torchao", "sklearn", "pandas", "wandb",
         "mlflow")
assert not [name for name in heavy if name in sys.modules], [name for name in heavy if name in sys.modules]
baseline = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
assert main(["export", {str(checkpoint)!r}, "--model", {str(tmp_path / "model_files")!r}, "--output",
             {str(tmp_path / "out")!r}, "--max_shard_size", "{shard}", "--allow_unverified_checkpoint"]) == 0
print(baseline, status("VmHWM"))
"""
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    check_ok(proc)
    baseline, peak = map(int, proc.stdout.split()[-2:])
    assert peak - baseline < 2 * shard, f"export peaked {peak - baseline:,} bytes above its baseline {baseline:,}"
    files = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(files) >= 4 and all(f.stat().st_size <= shard + 10**5 for f in files)
    written = {name: tensor for f in files for name, tensor in load_file(f).items()}
    assert written.keys() == state.keys()
    assert all(torch.equal(written[name], tensor) for name, tensor in state.items())
