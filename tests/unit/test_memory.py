"""Unit tests of the memory planner's command."""

from __future__ import annotations

import pytest

from conftest import REPO, run_in_process


def test_estimate_memory_says_what_fits(capsys):
    from finetune.cli import main

    assert main(["estimate-memory", "--model", "gpt2-small", "--num_processes", "4", "--device_memory", "1.5GB",
                 "--accelerate_config", str(REPO / "accelerate_configs" / "fsdp_shard_grad_op.yaml")]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ") and "---" not in line}
    # 124,439,808 params: DDP holds 16 bytes each on every device, 4-way FSDP a quarter of that.
    assert "| 497,759,232 | 497,759,232 | 995,518,464 |" in rows["DDP"]
    assert "| 124,439,808 | 124,439,808 | 248,879,616 |" in rows["FSDP full shard"]
    assert rows["DDP"].rstrip().endswith("| no |") and rows["FSDP full shard"].rstrip().endswith("| yes |")
    assert "runs: FSDP SHARD_GRAD_OP" in out
    # A CPU run's resident set: more than the tensors (the libraries, the heap); offload needs a GPU.
    assert "| peak RSS, CPU run |" in out and "| GPU only |" in rows["FSDP + CPU offload (state in CPU RAM)"]
    total, rss = (int(rows["FSDP full shard"].split("|")[i].split("(")[0].replace(",", "")) for i in (7, 8))
    assert rss > total


def test_a_reward_model_is_planned_with_its_score_head(capsys):
    """--method reward trains one score a sequence where DPO's pairs go
    through the vocabulary's logits: the same pairs, the parameters of GPT-2
    (its LM head tied to the embeddings) plus a 768-weight score head."""
    from finetune.cli import main

    def planned(method: str) -> list[int]:
        assert main(["estimate-memory", "--model", "gpt2-small", "--method", method, "--num_processes", "2",
                     "--per_device_batch_size", "4", "--block_size", "1024"]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("| FSDP full shard |"))
        return [int(out.split(" parameters")[0].replace(",", "")), int(row.split("|")[6].replace(",", ""))]

    (dpo_params, dpo_activations), (reward_params, reward_activations) = planned("dpo"), planned("reward")
    assert reward_params == dpo_params + 768
    # The logits DPO holds: 2 x 4 sequences x 1,024 tokens x 50,257 words, several bytes each.
    assert dpo_activations - reward_activations > 2 * 4 * 1024 * 50257 * 4


def test_estimate_memory_of_a_non_transformer_is_one_line(capsys):
    from finetune.cli import main

    assert main(["estimate-memory", "--model", "lecture-cnn"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: estimate-memory models transformer causal LMs")
    assert "lecture-cnn is an image-classification model" in err


def test_the_plan_names_the_layout_of_the_processes_asked_for(capsys, tmp_path):
    """tp.yaml (2 shards x TP 2 on 4 processes) planned on 6: 3 shards x TP 2, in the table and the last line."""
    from finetune.cli import main

    from sft_models import save_chat_model  # a family transformers has a tensor-parallel plan for

    model = save_chat_model(tmp_path / "llama")
    assert main(["estimate-memory", "--model", str(model), "--num_processes", "6", "--accelerate_config",
                 str(REPO / "accelerate_configs" / "tp.yaml")]) == 0
    out = capsys.readouterr().out
    assert "| FSDP 3 x TP 2 |" in out and out.rstrip().endswith("runs: FSDP 3 x TP 2")


def test_what_train_refuses_the_planner_refuses(capsys, tmp_path):
    from finetune.cli import main

    (tmp_path / "zero2.json").write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}')
    for args, words in ((["--loss_chunk_size", "-5"], "--loss_chunk_size: must be >= 0"),
                        (["--accelerate_config", str(tmp_path / "zero2.json")], "is a DeepSpeed config, not an "
                                                                                 "accelerate config")):
        assert main(["estimate-memory", "--model", "tiny-gpt2", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, err


@pytest.mark.parametrize("settings, words", [
    ("distributed_type: FSDP\nnum_processes: many\n", "num_processes is 'many', not a positive whole number"),
    ("distributed_type: FSDP\nnum_processes: -3\n", "num_processes is '-3', not a positive whole number"),
    ("num_machines: 0\n", "num_machines is '0', not a positive whole number"),
    ("fsdp_config: 3\ndistributed_type: FSDP\n", "fsdp_config is '3', not a mapping of settings"),
    ("mixed_precision: [bf16]\n", "mixed_precision is \"['bf16']\", not one of no, fp16, bf16, fp8"),
    ("distributed_type: 42\n", "distributed_type is '42', not a name such as FSDP"),
])
def test_a_damaged_accelerate_config_is_one_line(settings, words, tmp_path):
    (tmp_path / "launch.yaml").write_text(settings)
    proc = run_in_process("estimate-memory", "--model", "tiny-gpt2", "--accelerate_config", tmp_path / "launch.yaml")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr
    assert proc.stdout == ""


def test_packed_rows_cost_a_quadratic_mask_only_under_sdpa_and_eager():
    """Rows of several examples under sdpa hold a [batch, 1, block, block] mask
    (and the kernel's additive copy); flex attention, the GPU default, none."""
    def activations(*options: str) -> int:
        proc = run_in_process("estimate-memory", "--model", "gpt2-small", "--num_processes", "1", "--block_size",
                              "1024", "--per_device_batch_size", "2", *options)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        row = next(line for line in out.splitlines() if line.startswith("| FSDP full shard |"))
        return int(row.split("|")[6].replace(",", ""))  # the activations column

    plain = activations()
    assert activations("--packed") == plain  # flex attention: the position ids, nothing quadratic
    assert activations("--packed", "--attn_implementation", "flash_attention_2") == plain
    assert activations("--attn_implementation", "sdpa") == plain  # plain text blocks need no mask
    assert activations("--packed", "--attn_implementation", "sdpa") - plain == 2 * 1024 * 1024 * (1 + 2)  # bool + bf16
    assert activations("--packed", "--attn_implementation", "eager") - plain == 2 * 1024 * 1024 * (1 + 4)


def test_grpo_plans_its_kv_cache_its_full_logits_and_a_reference_only_with_a_kl_term(capsys):
    """gpt2-small (12 layers, 768 wide), 64 completions of 1024 tokens a rank in
    bf16: a KV cache of 2 x 12 x 768 x 64 x 1024 x 2 bytes, larger than the
    training activations it replaces while sampling; --beta adds DPO's reference."""
    from finetune.cli import main

    def plan(*extra) -> tuple[dict, str]:
        assert main(["estimate-memory", "--model", "gpt2-small", "--num_processes", "2", "--per_device_batch_size",
                     "64", "--block_size", "1024", "--mixed_precision", "bf16", *extra]) == 0
        out = capsys.readouterr().out
        return {line.split("|")[1].strip(): line.split("|") for line in out.splitlines()
                if line.startswith("| ") and "---" not in line}, out

    sft, _ = plan()
    grpo, out = plan("--method", "grpo")
    kv = 2 * 12 * 768 * 64 * 1024 * 2
    assert f"KV cache of up to {kv / 2**30:.2f} GiB a rank ({kv:,} bytes" in out
    activations = {name: int(row[6].replace(",", "")) for name, row in grpo.items() if name.startswith("FSDP full")}
    assert activations["FSDP full shard"] >= kv
    assert activations["FSDP full shard"] > int(sft["FSDP full shard"][6].replace(",", ""))  # the full logits
    assert "frozen reference" not in out  # none without a KL term
    with_kl, out = plan("--method", "grpo", "--beta", "0.04")
    assert "| frozen reference |" in out
    assert with_kl["FSDP full shard"][7].strip() == f"{124_439_808 // 2 * 4:,}"  # fp32, sharded as the parameters


def test_the_generation_engine_is_planned_beside_training(capsys):
    """GRPO's engine (--generation_engine): auto's replica, a whole bf16 copy
    of gpt2-small on each rank where the state is sharded; vLLM, its share of
    the device, with the KV cache that share holds after the weights; sampling
    from the model as held, nothing. Options of an engine on an objective that
    samples nothing are refused in one line."""
    from finetune.cli import main

    params = 124_439_808

    def plan(*extra) -> tuple[dict, str]:
        assert main(["estimate-memory", "--model", "gpt2-small", "--num_processes", "2", "--per_device_batch_size",
                     "8", "--block_size", "1024", "--mixed_precision", "bf16", "--method", "grpo", *extra]) == 0
        out = capsys.readouterr().out
        header = next(line for line in out.splitlines() if line.startswith("| strategy |"))
        column = [c.strip() for c in header.split("|")].index("generation engine") if "generation engine" in header else None
        rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines()
                if line.startswith("| ") and "---" not in line and not line.startswith("| strategy")}
        return {name: int(row[column].replace(",", "")) if column else None for name, row in rows.items()}, out

    auto, out = plan()
    assert auto["FSDP full shard"] == params * 2 and auto["DDP"] == 0
    assert "a whole copy of the policy, 0.23 GiB a rank" in out
    sharded, out = plan("--generation_engine", "sharded")
    assert set(sharded.values()) == {None} and "nothing beside training" in out
    device = 80 * 2**30
    vllm, out = plan("--generation_engine", "vllm", "--device_memory", str(device), "--vllm_gpu_memory_utilization", "0.25")
    assert set(vllm.values()) == {device // 4}
    tokens = (device // 4 - params * 2) // (2 * 12 * 768 * 2)
    assert f"a KV cache of about {tokens:,} tokens" in out
    tight, out = plan("--generation_engine", "vllm", "--device_memory", "4GiB", "--vllm_gpu_memory_utilization", "0.05")
    assert "which does not hold the weights (0.23 GiB): raise --vllm_gpu_memory_utilization" in out
    proc = run_in_process("estimate-memory", "--model", "gpt2-small", "--generation_engine", "replica")
    assert proc.returncode == 2 and "and --method is sft; drop them or pass --method grpo" in proc.stderr.strip()


def test_a_vision_language_model_is_planned_with_its_tower_and_images(tmp_path):
    """The tower's parameters are counted; kept frozen (train's default) it has
    no gradients or optimizer state and keeps no activations for backward;
    more images a row, or a trained tower, take more activations."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, Qwen2_5_VLConfig
    from vlm_models import save_vlm_model

    from finetune.errors import UsageError
    from finetune.estimates import activation_bytes
    from finetune.memory import model_shape

    llava = save_vlm_model(tmp_path / "llava", "llava")
    with torch.device("meta"):
        whole = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(llava))
    tower = sum(p.numel() for p in whole.model.vision_tower.parameters())
    frozen = model_shape(str(llava))
    assert frozen.params == sum(p.numel() for p in whole.parameters())
    assert frozen.trainable == frozen.params - tower
    assert (frozen.layers, frozen.hidden, frozen.image_patches, frozen.vision_layers) == (2, 32, 4, 2)
    trained, two_images = model_shape(str(llava), freeze_vision_tower=False), model_shape(str(llava), images_per_sample=2)
    assert trained.trainable == trained.params

    def acts(shape):
        return activation_bytes(shape, 8, 128, 2)
    assert acts(trained) > acts(frozen) > 0 and acts(two_images) > acts(frozen)

    qwen = tmp_path / "qwen"  # sizes images by pixel count: the plan needs --max_pixels
    Qwen2_5_VLConfig(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=300),
                     vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                                        fullatt_block_indexes=[1])).save_pretrained(qwen)
    with pytest.raises(UsageError, match="sizes its images by pixel count; pass --max_pixels"):
        model_shape(str(qwen))
    assert model_shape(str(qwen), max_pixels=28 * 28 * 16).image_patches == 64
