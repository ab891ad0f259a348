"""The families users fine-tune now, as tiny local models, under 2-process
FSDP2: each trains sharded, learns and exports to final/'s logits; a mixture
of experts with its load-balancing loss takes the same steps under DDP and
ZeRO-3; LoRA reaches the fused experts, merges as peft does and resumes
exactly after SIGTERM."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import check_ok, run_cli, run_cli_together, run_in_process, stopped_by_sigterm, train_rows
from sft_models import FAMILY_SHAPES, MOE_FAMILIES, conversations, save_family_model, write_jsonl

pytestmark = pytest.mark.slow

STEPS = 4


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("moe-data") / "chat.jsonl", conversations(48))


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: save_family_model(root / family, family) for family in FAMILY_SHAPES}


def train_args(model, data, run_dir, *extra) -> list:
    return ["train", "--model", model, "--dataset", data, "--block_size", "64", "--per_device_batch_size", "2",
            "--max_steps", str(STEPS), "--learning_rate", "3e-3", "--max_eval_batches", "1", "--sample_prompt", "",
            "--output_dir", run_dir, *extra]


def router_args(family: str) -> list[str]:
    return ["--output_router_logits"] if family in MOE_FAMILIES else []


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory, family_dirs, chat_data, env):
    """Each family's full fine-tune, made when a test first asks for it."""
    runs = {}

    def run(family: str):
        if family not in runs:
            run_dir = tmp_path_factory.mktemp(f"run-{family}") / "run"
            check_ok(run_cli(train_args(family_dirs[family], chat_data, run_dir, *router_args(family)), env,
                             mixed_precision="no", warm=True))
            runs[family] = run_dir
        return runs[family]
    run.dirs = family_dirs
    return run


def tensors(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.mark.parametrize("family", list(FAMILY_SHAPES))
def test_each_family_trains_sharded_learns_and_exports_the_same_logits(family, family_runs, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = family_runs(family)
    summary = json.loads((run_dir / "summary.json").read_text())
    shards = summary["local_params_per_rank"]
    assert summary["distributed_type"] == "FSDP" and summary["fsdp_version"] == 2
    assert len(shards) == 2 and all(0 < s < summary["total_params"] for s in shards)  # each rank holds a part
    assert sum(shards) >= summary["total_params"]
    rows = train_rows(run_dir)
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
    if family in MOE_FAMILIES:  # the routers: their loss and each expert's load, logged and summed up
        assert all(r["aux_loss"] > 0 and 0 < r["expert_load_entropy"] <= 1 for r in rows)
        load = summary["expert_load"]
        assert load["experts"] == 4 and len(load["per_layer"]) == 2
        assert all(0 <= layer["min"] <= 0.25 <= layer["max"] <= 1 for layer in load["per_layer"])
    if family in MOE_FAMILIES:  # the planner's state per rank, every expert held, against what each rank held
        from finetune.memory import estimate, model_shape

        rows = estimate(model_shape(str(family_runs.dirs[family])), 2, batch=2, block_size=64, mixed_precision="no")
        planned = next(e for e in rows if e.strategy == "FSDP full shard").state
        for held in summary["state_bytes_per_rank"]:
            assert abs(held - planned) < 0.1 * planned, (held, planned)
    check_ok(run_in_process("export", run_dir, "--output", tmp_path / "export"))
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        final, exported = (AutoModelForCausalLM.from_pretrained(d).eval()(tokens).logits
                           for d in (run_dir / "final", tmp_path / "export"))
    assert torch.equal(final, exported)


def test_a_mixture_of_experts_takes_fsdps_steps_under_ddp_and_zero3(family_runs, family_dirs, chat_data, tmp_path,
                                                                   env):
    """Mixtral with its load-balancing loss: loss, aux_loss, grad norm and
    expert load per step as FSDP2's, to 1e-4 (the two runs side by side)."""
    fsdp = {r["step"]: r for r in train_rows(family_runs("mixtral"))}
    configs = ("ddp.yaml", "zero3.yaml")
    procs = run_cli_together([(train_args(family_dirs["mixtral"], chat_data, tmp_path / config,
                                           "--output_router_logits"), {"config": config, "mixed_precision": "no"})
                              for config in configs], env)
    for config, proc in zip(configs, procs):
        check_ok(proc)
        other = {r["step"]: r for r in train_rows(tmp_path / config)}
        assert sorted(other) == sorted(fsdp) == list(range(1, STEPS + 1))
        for step, row in other.items():
            for metric in ("loss", "aux_loss", "grad_norm", "expert_load_max", "expert_load_entropy"):
                assert row[metric] == pytest.approx(fsdp[step][metric], rel=1e-4, abs=1e-4), (config, step, metric)


def test_moe_lora_reaches_the_experts_merges_as_peft_and_resumes_exactly_after_sigterm(family_dirs, chat_data,
                                                                                         tmp_path, env):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = family_dirs["qwen3_moe"]
    lora = ["--peft", "lora", "--learning_rate", "1e-2", "--checkpoint_every", "2"]
    straight = tmp_path / "straight"
    proc = run_cli(train_args(base, chat_data, straight, *lora), env, mixed_precision="no", warm=True)
    check_ok(proc)
    assert "no dropout on the adapters of mlp.experts.down_proj, mlp.experts.gate_up_proj" in proc.stdout

    stopped = tmp_path / "stopped"
    err = stopped_by_sigterm(train_args(base, chat_data, stopped, *lora), env, stopped / "checkpoints" / "step_000002")
    assert "stopped: SIGTERM at step" in err, err[-3000:]
    check_ok(run_cli(["resume", stopped], env, mixed_precision="no", warm=True))
    assert [r["step"] for r in train_rows(stopped)][-1] == STEPS
    theirs, ours = tensors(straight / "final"), tensors(stopped / "final")
    assert theirs.keys() == ours.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)

    check_ok(run_in_process("export", straight, "--adapter_only", "--output", tmp_path / "adapter"))
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(".mlp.experts.lora_A." in k for k in keys) and any(".mlp.experts.base_layer.lora_B." in k for k in keys)
    assert not any(".mlp.gate.lora_" in k for k in keys)  # all-linear leaves the routers alone
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = AutoModelForCausalLM.from_pretrained(base).eval()(tokens).logits
        merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
        merged = merged.merge_and_unload().eval()(tokens).logits
        final = AutoModelForCausalLM.from_pretrained(straight / "final").eval()(tokens).logits
    assert (final - before).abs().max() > 1e-2  # the adapters moved the model
    torch.testing.assert_close(final, merged, rtol=0, atol=1e-5)
