"""LoRA (--peft lora) under FSDP2 on 2 CPU processes: what trains, what a
checkpoint holds, exact and resharded resume, the merged and adapter-only
exports against peft's own loading and merging, and the refusals."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import check_ok, eval_rows, launches, run_cli, run_in_process, train_rows
from sft_models import chat_tokenizer, conversations, save_chat_model, write_jsonl
from e2e.test_errors import one_error_line
from e2e.test_resume import assert_same_state, consolidated, flatten

pytestmark = pytest.mark.slow

# fp32 (exact comparisons), eval on 2 batches, no sample.
QUIET = ["--block_size", "64", "--per_device_batch_size", "2", "--max_eval_batches", "2", "--sample_prompt", ""]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A GPT-2 (Conv1D layers, tied embeddings) wide enough that r=8 adapters are ~2% of it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    texts = [m["content"] for row in conversations(200) for m in row["messages"]]
    tokenizer = chat_tokenizer(texts)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=512, n_layer=2, n_head=8, n_positions=256,
                                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    path = tmp_path_factory.mktemp("gpt2") / "base"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
@launches
def lora_run(tmp_path_factory, env, small_corpus, gpt2_dir):
    """6 steps of LoRA r=8 (all-linear, dropout on) on 2 processes, a checkpoint every 3."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    check_ok(run_cli(["train", "--model", str(gpt2_dir), "--dataset", str(small_corpus), *QUIET, "--peft", "lora",
                      "--lora_r", "8", "--learning_rate", "3e-3", "--max_steps", "6", "--checkpoint_every", "3",
                      "--output_dir", str(run_dir)], env, mixed_precision="no", warm=True))
    return run_dir


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def test_only_the_adapters_train_and_the_state_is_as_predicted(lora_run, gpt2_dir, tmp_path):
    summary = json.loads((lora_run / "summary.json").read_text())
    assert summary["peft"] == "lora" and summary["distributed_type"] == "FSDP"
    assert 0 < summary["trainable_params"] < 0.05 * summary["total_params"]
    assert sum(summary["local_params_per_rank"]) == summary["total_params"]  # base and adapters both sharded
    assert max(summary["local_params_per_rank"]) < summary["total_params"]

    # final/ is the in-memory model at the end, merged. Tensors without adapters
    # must equal the base's bit for bit; those with adapters must equal the
    # base from disk merged with the trained adapters by peft: a base weight
    # that moved in training would show in either.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert run_in_process("export", lora_run, "--adapter_only", "--output", tmp_path / "adapter").returncode == 0
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert adapter and all(".lora_" in name for name in adapter)
    assert all(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name)  # peft starts B at 0: it trained
    base = load_file(gpt2_dir / "model.safetensors")
    final = load_file(lora_run / "final" / "model.safetensors")
    assert final.keys() == base.keys()
    adapted = {name.split(".lora_")[0].removeprefix("base_model.model.") + ".weight" for name in adapter}
    assert adapted and adapted < final.keys()
    for name in final.keys() - adapted:
        assert torch.equal(final[name], base[name]), name
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(gpt2_dir), tmp_path / "adapter")
    merged = merged.merge_and_unload().state_dict()
    for name in adapted:
        assert not torch.equal(final[name], base[name]), name
        torch.testing.assert_close(final[name], merged[name], rtol=0, atol=1e-6, msg=name)

    # Per-rank parameters, gradients and AdamW state, as estimate-memory predicts them.
    proc = run_in_process("estimate-memory", "--model", gpt2_dir, "--num_processes", "2", "--peft", "lora",
                          "--lora_r", "8", "--mixed_precision", "no")
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| FSDP full shard"))
    params, grads, optimizer = (int(cell.replace(",", "")) for cell in row.split("|")[2:5])
    for measured in summary["state_bytes_per_rank"]:
        assert measured == pytest.approx(params + grads + optimizer, rel=0.10)
    assert grads < params / 20  # the frozen base has no gradients and no optimizer state

    evals = eval_rows(lora_run)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.05  # it learns


def test_a_checkpoint_holds_the_adapters_and_is_small(lora_run, tmp_path, env, small_corpus, gpt2_dir):
    checkpoint = lora_run / "checkpoints" / "step_000006"
    assert sorted(p.name for p in (checkpoint / "pytorch_model_fsdp_0").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]
    stored = flatten(consolidated(checkpoint / "pytorch_model_fsdp_0", tmp_path))
    assert stored and all(".lora_" in name for name in stored)
    assert json.loads((checkpoint / "model_config" / "peft_base.json").read_text())["model"] == str(gpt2_dir)

    full_run = tmp_path / "full"
    check_ok(run_cli(["train", "--model", str(gpt2_dir), "--dataset", str(small_corpus), *QUIET, "--max_steps", "1",
                      "--max_eval_batches", "1", "--output_dir", str(full_run)], env, mixed_precision="no", warm=True))

    def size(path):
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    full_checkpoint = full_run / "checkpoints" / "step_000001"
    assert size(checkpoint) < 0.05 * size(full_checkpoint), (size(checkpoint), size(full_checkpoint))

    # What a LoRA run is not: a full fine-tune has no adapters, and resumes as one.
    proc = run_in_process("export", full_run, "--adapter_only", "--output", tmp_path / "nothing")
    assert proc.returncode == 2 and "full fine-tune" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run_in_process("resume", full_run, "--peft", "lora")
    assert proc.returncode == 2 and "--peft ('none' -> 'lora')" in proc.stderr
    proc = run_in_process("resume", lora_run, "--peft", "none")
    assert proc.returncode == 2 and "--peft ('lora' -> 'none')" in proc.stderr
    assert not (tmp_path / "nothing").exists()


def test_resume_is_exact(lora_run, tmp_path, env):
    resumed = tmp_path / "resumed"
    check_ok(run_cli(["train", "--config", str(lora_run / "run_config.yaml"), "--resume_from_checkpoint",
                      str(lora_run / "checkpoints" / "step_000003"), "--output_dir", str(resumed)], env,
                     mixed_precision="no", warm=True))
    full = {r["step"]: r for r in train_rows(lora_run)}
    rows = train_rows(resumed)
    assert [r["step"] for r in rows] == [4, 5, 6]
    for row in rows:  # with adapter dropout on: the RNG streams came back too
        assert row["loss"] == pytest.approx(full[row["step"]]["loss"], abs=1e-6)
        assert row["grad_norm"] == pytest.approx(full[row["step"]]["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("world_size", [1, 3])
def test_resume_on_another_world_size_keeps_adapters_and_optimizer(lora_run, tmp_path, env, world_size):
    saved = lora_run / "checkpoints" / "step_000003"
    run_dir = tmp_path / f"on{world_size}"
    check_ok(run_cli(["train", "--config", str(lora_run / "run_config.yaml"), "--max_steps", "3",
                      "--resume_from_checkpoint", str(saved), "--output_dir", str(run_dir)], env, nproc=world_size,
                     mixed_precision="no", warm=True))
    resaved = run_dir / "checkpoints" / "step_000003"
    assert len(list((resaved / "pytorch_model_fsdp_0").glob("*.distcp"))) == world_size
    optimizer = assert_same_state(saved, resaved, tmp_path)
    assert any("exp_avg_sq" in k and ".lora_" in k for k in optimizer)


def test_exports_match_peft(lora_run, gpt2_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert run_in_process("export", lora_run, "--output", tmp_path / "merged").returncode == 0
    assert run_in_process("export", lora_run, "--adapter_only", "--output", tmp_path / "adapter").returncode == 0
    vocab = json.loads((gpt2_dir / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))

    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(gpt2_dir), tmp_path / "adapter").eval()
    at_the_end = AutoModelForCausalLM.from_pretrained(lora_run / "final").eval()
    # The adapter-only export gives the model training ended with.
    torch.testing.assert_close(logits(with_adapter, tokens), logits(at_the_end, tokens), rtol=0, atol=1e-5)
    # The merged export is peft's merge_and_unload of that adapter.
    by_peft = with_adapter.merge_and_unload()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(logits(merged, tokens), logits(by_peft, tokens), rtol=0, atol=1e-5)
    assert merged.lm_head.weight.data_ptr() == merged.transformer.wte.weight.data_ptr()  # still tied
    from huggingface_hub import ModelCard

    adapter_card, merged_card = (ModelCard.load(tmp_path / d / "README.md") for d in ("adapter", "merged"))
    assert adapter_card.data.library_name == "peft" and "PeftModel.from_pretrained" in adapter_card.text
    assert "this dir holds the adapters alone" in adapter_card.text and "lora" in adapter_card.data.tags
    assert merged_card.data.library_name == "transformers" and "merged into the weights here" in merged_card.text


def test_gguf_export_of_a_lora_run_holds_the_merged_model(lora_run, tmp_path):
    """From the run's newest checkpoint: every GGUF tensor is the merged
    export's, in llama.cpp's layout (GPT-2's Conv1D weights as (out, in)),
    to f16 rounding; the merged model dir it went through is gone."""
    import gguf

    assert run_in_process("export", lora_run, "--output", tmp_path / "merged").returncode == 0
    check_ok(run_in_process("export", lora_run, "--format", "gguf", "--output", tmp_path / "out" / "lora.gguf"))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["lora.gguf"]
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, 2)
    expected = {names.get_name(name, try_suffixes=(".weight", ".bias")): tensor for name, tensor in merged.items()}
    expected["output.weight"] = merged["transformer.wte.weight"]  # tied: llama.cpp's GPT-2 reads an output matrix
    read = {}
    for tensor in gguf.GGUFReader(str(tmp_path / "out" / "lora.gguf")).tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        read[tensor.name] = torch.from_numpy(values.reshape(tuple(reversed(tensor.shape.tolist()))).copy())
    assert read.keys() == expected.keys()
    for name, tensor in expected.items():
        conv1d = name.endswith(("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight"))
        torch.testing.assert_close(read[name], tensor.t() if conv1d else tensor, rtol=1e-3, atol=1e-7, msg=name)


def test_a_changed_base_is_refused(lora_run, gpt2_dir, tmp_path, env):
    changed = tmp_path / "changed"
    shutil.copytree(gpt2_dir, changed)
    weights = load_file(changed / "model.safetensors")
    weights["transformer.h.1.mlp.c_fc.weight"][0, 0] += 1.0  # same shapes, one weight moved
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})

    proc = run_in_process("export", lora_run, "--model", changed, "--output", tmp_path / "out")
    assert proc.returncode == 2 and "are not those the adapters" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
    before = sorted(p.name for p in (lora_run / "checkpoints").iterdir())
    # Typed in a plain shell: relaunched as the run was, and the workers' exit code comes back.
    proc = run_cli(["resume", str(lora_run), "--model", str(changed), "--max_steps", "8"], env, nproc=None, warm=True)
    assert proc.returncode == 2 and "are not those the adapters" in proc.stderr, proc.stderr[-2000:]
    assert "relaunching" not in proc.stdout  # found before any process started
    assert not re.search(r"\[rank\d\]: Traceback", proc.stderr), proc.stderr[-3000:]  # no rank died with a traceback
    assert sorted(p.name for p in (lora_run / "checkpoints").iterdir()) == before


def test_lora_on_a_bfloat16_base_learns_on_chat_data_with_named_targets(tmp_path, env):
    """SFT (chat) on a Llama-style model held in bf16, fp32 adapters on the modules named only."""
    model_dir = save_chat_model(tmp_path / "llama", arch="llama", tie=False)
    data = write_jsonl(tmp_path / "chat.jsonl", conversations(160, seed=1))
    run_dir = tmp_path / "run"
    check_ok(run_cli(["train", "--model", str(model_dir), "--dataset", str(data), "--peft", "lora",
                      "--model_dtype", "bfloat16", "--lora_target_modules", "q_proj,v_proj,down_proj", "--lora_r", "4",
                      "--learning_rate", "3e-2", "--block_size", "128", "--per_device_batch_size", "4",
                      "--max_steps", "10", "--sample_prompt", "", "--output_dir", str(run_dir)], env,
                     mixed_precision="no", warm=True))
    evals = eval_rows(run_dir)
    assert evals[-1]["eval_loss"] < 0.99 * evals[0]["eval_loss"]  # a random base: the adapters alone move it
    config = json.loads((run_dir / "checkpoints" / "step_000010" / "model_config" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]

    assert run_in_process("export", run_dir, "--adapter_only", "--output", tmp_path / "adapter").returncode == 0
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert {t.dtype for t in adapter.values()} == {torch.float32}
    assert {name.split(".")[-3] for name in adapter} == {"q_proj", "v_proj", "down_proj"}
    # A bf16 base (2 bytes), fp32 adapters with fp32 gradients and AdamW moments, as predicted.
    proc = run_in_process("estimate-memory", "--model", model_dir, "--num_processes", "2", "--peft", "lora",
                          "--lora_r", "4", "--lora_target_modules", "q_proj,v_proj,down_proj",
                          "--model_dtype", "bfloat16", "--mixed_precision", "no")
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| FSDP full shard"))
    predicted = sum(int(cell.replace(",", "")) for cell in row.split("|")[2:5])
    summary = json.loads((run_dir / "summary.json").read_text())
    for measured in summary["state_bytes_per_rank"]:
        assert measured == pytest.approx(predicted, rel=0.10)
    for state, params in zip(summary["state_bytes_per_rank"], summary["local_params_per_rank"]):
        assert state < 4 * params  # less than the shard alone would take in fp32


def test_a_target_module_that_matches_nothing_is_one_line(tmp_path, env, small_corpus):
    model_dir = save_chat_model(tmp_path / "llama")
    proc = run_cli(["train", "--model", str(model_dir), "--dataset", str(small_corpus), "--peft", "lora",
                    "--lora_target_modules", "q_proj,nothing_here", "--max_steps", "1",
                    "--output_dir", str(tmp_path / "run")], env, nproc=None, warm=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "names nothing_here, which matches no module" in errors[0], proc.stderr[-2000:]
    assert "k_proj" in errors[0]  # the model's own linear layers are listed
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_qlora_on_cpu_is_one_line(tmp_path):
    proc = run_in_process("train", "--peft", "qlora", "--output_dir", tmp_path / "run")
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


# --- QLoRA: the same adapters on a 4-bit (NF4) base. Its code path runs on CPU here only through
# FINETUNE_QLORA_ON_CPU (the CLI refuses QLoRA without a GPU); fp32 compute, so comparisons are exact.

NF4_BYTES_PER_WEIGHT = (4 + 8 / 64 + 32 / (64 * 256)) / 8  # 4-bit codes, an int8 scale per 64, an fp32 scale per 256 scales


@pytest.fixture(scope="module")
@launches
def qlora_run(tmp_path_factory, env, small_corpus, gpt2_dir):
    """The LoRA run's 6 steps with --peft qlora."""
    pytest.importorskip("torchao")
    run_dir = tmp_path_factory.mktemp("qlora") / "run"
    check_ok(run_cli(["train", "--model", str(gpt2_dir), "--dataset", str(small_corpus), *QUIET, "--peft", "qlora",
                      "--lora_r", "8", "--learning_rate", "3e-3", "--max_steps", "6", "--checkpoint_every", "3",
                      "--output_dir", str(run_dir)], {**env, "FINETUNE_QLORA_ON_CPU": "1"}, mixed_precision="no", warm=True))
    return run_dir


def test_qlora_holds_the_adapted_base_in_4_bits_and_merges_into_the_original(qlora_run, lora_run, gpt2_dir, tmp_path):
    summary = json.loads((qlora_run / "summary.json").read_text())
    assert summary["peft"] == "qlora" and summary["distributed_type"] == "FSDP"
    assert sum(summary["local_params_per_rank"]) == summary["total_params"]
    assert max(summary["local_params_per_rank"]) < summary["total_params"]

    # Against the same LoRA run in fp32, each rank saves 4 bytes less ~0.52 per adapted base weight it holds:
    # GPT-2's Conv1D weights (c_attn, c_proj, c_fc), split over 2 ranks.
    base = load_file(gpt2_dir / "model.safetensors")
    adapted = {name for name, t in base.items() if t.dim() == 2 and name.split(".")[-2] in ("c_attn", "c_proj", "c_fc")}
    per_rank = sum(base[name].numel() for name in adapted) // 2
    lora_summary = json.loads((lora_run / "summary.json").read_text())
    for full, four_bit in zip(lora_summary["state_bytes_per_rank"], summary["state_bytes_per_rank"]):
        assert full - four_bit == pytest.approx(per_rank * (4 - NF4_BYTES_PER_WEIGHT), rel=0.01)
    proc = run_in_process("estimate-memory", "--model", gpt2_dir, "--num_processes", "2", "--peft", "qlora",
                          "--lora_r", "8", "--mixed_precision", "no")
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| FSDP full shard"))
    predicted = sum(int(cell.replace(",", "")) for cell in row.split("|")[2:5])
    for measured in summary["state_bytes_per_rank"]:
        assert measured == pytest.approx(predicted, rel=0.10)

    # The adapters trained on the 4-bit base; final/ merges them into the fp32 weights it was quantised from,
    # exactly as peft merges the exported adapter into the base from disk.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert run_in_process("export", qlora_run, "--adapter_only", "--output", tmp_path / "adapter").returncode == 0
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert all(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name)
    assert {name.split(".lora_")[0].removeprefix("base_model.model.") + ".weight" for name in adapter} == adapted
    final = load_file(qlora_run / "final" / "model.safetensors")
    assert final.keys() == base.keys()
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(gpt2_dir), tmp_path / "adapter")
    merged = merged.merge_and_unload().state_dict()
    for name in final:
        if name in adapted:
            assert not torch.equal(final[name], base[name]), name
            torch.testing.assert_close(final[name], merged[name], rtol=0, atol=1e-6, msg=name)
        else:
            assert torch.equal(final[name], base[name]), name
    assert run_in_process("export", qlora_run, "--output", tmp_path / "merged").returncode == 0
    exported = load_file(tmp_path / "merged" / "model.safetensors")
    assert all(torch.equal(exported[name], final[name]) for name in final)

    evals = eval_rows(qlora_run)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.05  # it learns


def test_qlora_resume_is_exact(qlora_run, tmp_path, env):
    resumed = tmp_path / "resumed"
    check_ok(run_cli(["train", "--config", str(qlora_run / "run_config.yaml"), "--resume_from_checkpoint",
                      str(qlora_run / "checkpoints" / "step_000003"), "--output_dir", str(resumed)],
                     {**env, "FINETUNE_QLORA_ON_CPU": "1"}, mixed_precision="no", warm=True))
    full = {r["step"]: r for r in train_rows(qlora_run)}
    rows = train_rows(resumed)
    assert [r["step"] for r in rows] == [4, 5, 6]
    for row in rows:
        assert row["loss"] == pytest.approx(full[row["step"]]["loss"], abs=1e-6)
        assert row["grad_norm"] == pytest.approx(full[row["step"]]["grad_norm"], rel=1e-5)


def test_qlora_under_bf16_mixed_precision_has_finite_losses(tmp_path, env, small_corpus, gpt2_dir):
    """fsdp.yaml's own mixed precision (what a GPU run uses): FSDP2 gathers the
    4-bit weights as they are and they dequantise to bf16 inside each layer.
    6 steps: bf16 matmuls are slow on CPUs without bf16 instructions."""
    pytest.importorskip("torchao")
    run_dir = tmp_path / "run"
    check_ok(run_cli(["train", "--model", str(gpt2_dir), "--dataset", str(small_corpus), *QUIET, "--peft", "qlora",
                      "--max_steps", "6", "--max_eval_batches", "1", "--output_dir", str(run_dir)],
                     {**env, "FINETUNE_QLORA_ON_CPU": "1"}, mixed_precision="bf16", warm=True))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mixed_precision"] == "bf16" and summary["peft"] == "qlora"
    rows = train_rows(run_dir)
    assert len(rows) == 6
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)


def test_qlora_on_one_process_of_fsdp_yaml_trains_and_resumes(tmp_path, env, small_corpus, gpt2_dir):
    """One GPU under fsdp.yaml: a launch of one process, in the config's bf16.
    Accelerate's one-copy loading would broadcast the 4-bit weights, and FSDP2
    on one rank rebuilds a weight from one of NF4's three all-gather inputs:
    the run must leave both to the ranks and still train, save and resume."""
    pytest.importorskip("torchao")
    run_dir, qlora_env = tmp_path / "run", {**env, "FINETUNE_QLORA_ON_CPU": "1"}
    proc = run_cli(["train", "--model", str(gpt2_dir), "--dataset", str(small_corpus), *QUIET, "--peft", "qlora",
                    "--max_steps", "2", "--checkpoint_every", "1", "--max_eval_batches", "1",
                    "--output_dir", str(run_dir)], qlora_env, nproc=1, mixed_precision="bf16", warm=True)
    check_ok(proc)
    assert re.search(r"4-bit \(NF4\) base weights in (\d+) of \1 adapted layers", proc.stdout), proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["distributed_type"], summary["world_size"], summary["mixed_precision"]) == ("FSDP", 1, "bf16")
    check_ok(run_cli(["train", "--config", str(run_dir / "run_config.yaml"), "--resume_from_checkpoint",
                      str(run_dir / "checkpoints" / "step_000001"), "--output_dir", str(tmp_path / "resumed")],
                     qlora_env, nproc=1, mixed_precision="bf16", warm=True))
    full, resumed = train_rows(run_dir), train_rows(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [2]
    assert all(math.isfinite(r["loss"]) for r in full)
    assert resumed[0]["loss"] == pytest.approx(full[1]["loss"], rel=1e-3)


def test_qlora_outside_fsdp2_is_one_line(tmp_path, env, small_corpus, gpt2_dir):
    pytest.importorskip("torchao")
    proc = run_cli(["train", "--model", str(gpt2_dir), "--dataset", str(small_corpus), *QUIET, "--peft", "qlora",
                    "--max_steps", "1", "--output_dir", str(tmp_path / "run")], {**env, "FINETUNE_QLORA_ON_CPU": "1"},
                   config="ddp.yaml", mixed_precision="no")
    assert proc.returncode != 0  # each rank exits 2; the launcher reports them failed (exit 1)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and "with FSDP2 only" in errors[0], proc.stderr[-2000:]
    assert not re.search(r"\[rank\d\]: Traceback", proc.stderr), proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("options, message", [
    (["--peft", "lora", "--lora_r", "0"], "--lora_r must be > 0"),
    (["--lora_r", "4"], "--lora_r is read by --peft lora or qlora, not by --peft none; drop --lora_r, or pass --peft lora"),
    (["--peft", "lora", "--task", "image-classification"], "--peft lora is for language models"),
    (["--peft", "lora", "--lora_target_modules", "ln_f", "--max_steps", "1"], "names ln_f, a LayerNorm, which takes no"),
])
def test_lora_option_errors(options, message, tmp_path):
    proc = run_in_process("train", *options, "--output_dir", tmp_path / "run")
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_planner_refuses_a_target_that_takes_no_adapter():
    proc = run_in_process("estimate-memory", "--model", "tiny-gpt2", "--peft", "lora", "--lora_target_modules", "ln_f")
    assert proc.returncode == 2 and "names ln_f, a LayerNorm, which takes no LoRA adapter" in one_error_line(proc.stderr)


def test_export_never_takes_trust_remote_code_from_the_run(lora_run, gpt2_dir, tmp_path):
    """The LoRA export rebuilds the base as the checkpoint's run_config.yaml
    records it; a record that says trust_remote_code, with a base whose code
    would run, is refused in one line unless the export's own command line says so."""
    import yaml

    base = tmp_path / "base"
    shutil.copytree(gpt2_dir, base)
    marker = tmp_path / "code-ran"
    (base / "custom.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                    "from transformers import GPT2Config\n"
                                    "class CustomConfig(GPT2Config):\n    model_type = 'custom-gpt2'\n")
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "model_type": "custom-gpt2",
                                                  "auto_map": {"AutoConfig": "custom.CustomConfig"}}))
    run_dir = tmp_path / "run"
    shutil.copytree(lora_run, run_dir)
    checkpoint = sorted((run_dir / "checkpoints").iterdir())[-1]
    record = yaml.safe_load((checkpoint / "run_config.yaml").read_text())
    (checkpoint / "run_config.yaml").write_text(yaml.safe_dump({**record, "model": str(base),
                                                                "trust_remote_code": True}))
    proc = run_in_process("export", checkpoint, "--output", tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert "sets trust_remote_code" in line and "pass --trust_remote_code if you trust" in line
    assert not marker.exists() and not (tmp_path / "out").exists()
