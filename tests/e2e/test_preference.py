"""Preference tuning (--method dpo / simpo): TRL's pair formats, the losses and
rewards against an independent computation with transformers alone, ln 2 at
the first step, the reference (adapters off under LoRA, a sharded frozen copy
otherwise), learning a preference, exact resume, and bad input in one line."""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import check_ok, launches, read_jsonl, run_cli, run_cli_together, run_in_process, train_rows
from e2e.test_errors import snapshot
from finetune.config import TrainConfig
from finetune.data.chat import IGNORE
from finetune.data.preference import PairCollator, PairEncoder, split_pair
from finetune.errors import UsageError
from finetune.objectives import REGISTRY as OBJECTIVES
from finetune.objectives.preference_loss import PairLogps
from sft_models import save_chat_model, write_jsonl

GOOD = "reads returns sorted writes changes".split()   # the preferred answers use these words
BAD = "error disk nothing file lines".split()          # the dispreferred ones these


def pairs(count: int, seed: int, conversational: bool) -> list[dict]:
    """A learnable preference: chosen answers from GOOD, rejected from BAD."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        prompt = f"the model {' '.join(rng.choice(GOOD + BAD) for _ in range(rng.randint(2, 5)))}\n"
        chosen = " ".join(rng.choice(GOOD) for _ in range(rng.randint(2, 6)))
        rejected = " ".join(rng.choice(BAD) for _ in range(rng.randint(2, 6)))
        if conversational:
            rows.append({"prompt": [{"role": "user", "content": prompt.strip()}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """A chat model, and another of the same shape and tokenizer (other weights) to serve as a reference."""
    root = tmp_path_factory.mktemp("pref-models")
    policy = save_chat_model(root / "policy")
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_pretrained(policy)
    for p in other.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    other.save_pretrained(root / "reference")
    AutoTokenizer.from_pretrained(policy).save_pretrained(root / "reference")
    return policy, root / "reference"


def data_dir(root: Path, conversational: bool, train: int = 64, validation: int = 16) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_jsonl(root / "train.jsonl", pairs(train, 0, conversational))
    write_jsonl(root / "validation.jsonl", pairs(validation, 1, conversational))
    return root


QUIET = ["--block_size", "64", "--sample_prompt", "", "--log_format", "plain", "--per_device_batch_size", "4"]


# --- formats and losses, in process ---------------------------------------------------------------

def test_the_three_formats_split_into_prompt_and_completions():
    user = {"role": "user", "content": "what does it do"}
    good, bad = ({"role": "assistant", "content": c} for c in ("it reads", "it writes"))
    assert split_pair({"prompt": "q\n", "chosen": "a", "rejected": "b"}, "example 1") == ("q\n", "a", "b")
    assert split_pair({"prompt": [user], "chosen": [good], "rejected": [bad]}, "example 1") == ([user], [good], [bad])
    # implicit: the shared leading messages are the prompt
    assert split_pair({"chosen": [user, good], "rejected": [user, bad]}, "example 1") == ([user], [good], [bad])
    for row, says in (({"prompt": "q", "chosen": "a", "rejected": "a"}, "are the same"),
                      ({"prompt": "q", "chosen": "", "rejected": "b"}, "chosen must be non-empty"),
                      ({"chosen": [user, good], "rejected": [bad]}, "share no leading prompt"),
                      ({"prompt": [user], "chosen": "a", "rejected": [bad]}, "must be lists of messages")):
        with pytest.raises(UsageError, match=says):
            split_pair(row, "example 7")


def test_pairs_are_labelled_on_the_completion_only_and_stacked_chosen_first(models):
    tokenizer = AutoTokenizer.from_pretrained(models[0])
    encoder = PairEncoder(tokenizer)
    row = pairs(1, 3, conversational=True)[0]
    encoded = encoder.encode(row, 0)
    for side in ("chosen", "rejected"):
        ids, labels = encoded[f"{side}_input_ids"], encoded[f"{side}_labels"]
        # The completion's tokens, through its end-of-turn token, are the only targets.
        answer = tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE])
        assert answer == row[side][0]["content"] + "<|im_end|>"
        rendered = tokenizer.apply_chat_template(row["prompt"] + row[side], tokenize=False)
        assert tokenizer.decode(ids) == rendered
    batch = PairCollator(tokenizer.pad_token_id)([{**encoded, "pair": 0}, {**encoder.encode(pairs(2, 4, True)[1], 1),
                                                                          "pair": 1}])
    assert batch["pair"].tolist() == [0, 1]
    assert batch["input_ids"].shape[0] == 4
    first = torch.tensor(encoded["chosen_input_ids"])
    assert torch.equal(batch["input_ids"][0, :len(first)], first)
    assert torch.equal(batch["input_ids"][2, :len(encoded["rejected_input_ids"])],
                       torch.tensor(encoded["rejected_input_ids"]))


def pair_losses(objective: str, policy: PairLogps, reference: PairLogps | None, **options):
    return OBJECTIVES[objective].pair_losses(TrainConfig(objective=objective, **options), policy, reference)


def test_losses_follow_their_formulas():
    policy = PairLogps(torch.tensor([-10.0, -4.0]), torch.tensor([-12.0, -3.0]), torch.tensor([5, 2]),
                       torch.tensor([4, 3]))
    reference = PairLogps(torch.tensor([-11.0, -4.5]), torch.tensor([-11.0, -4.0]), policy.chosen_tokens,
                          policy.rejected_tokens)
    beta = 0.5
    logits = torch.tensor([(-10 + 12) - (-11 + 11), (-4 + 3) - (-4.5 + 4)])  # 2, -0.5
    sigmoid = pair_losses("dpo", policy, reference, dpo_beta=beta, dpo_loss="sigmoid")
    torch.testing.assert_close(sigmoid.losses, torch.log1p(torch.exp(-beta * logits)))
    torch.testing.assert_close(sigmoid.metrics["rewards/chosen"], beta * torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(sigmoid.metrics["rewards/accuracies"], (logits > 0).float())
    hinge = pair_losses("dpo", policy, reference, dpo_beta=beta, dpo_loss="hinge")
    torch.testing.assert_close(hinge.losses, torch.clamp(1 - beta * logits, min=0))
    ipo = pair_losses("dpo", policy, reference, dpo_beta=beta, dpo_loss="ipo")
    per_token = torch.tensor([(-10 / 5 + 12 / 4) - (-11 / 5 + 11 / 4), (-4 / 2 + 3 / 3) - (-4.5 / 2 + 4 / 3)])
    torch.testing.assert_close(ipo.losses, (per_token - 1 / (2 * beta)) ** 2)
    simpo = pair_losses("simpo", policy, None, dpo_beta=2.0, simpo_gamma=0.5)
    margin = torch.tensor([-10 / 5 + 12 / 4, -4 / 2 + 3 / 3])
    torch.testing.assert_close(simpo.losses, torch.log1p(torch.exp(-(2.0 * margin - 0.5))))
    torch.testing.assert_close(simpo.metrics["rewards/rejected"], 2.0 * torch.tensor([-3.0, -1.0]))


# --- runs -----------------------------------------------------------------------------------------

def completion_logps(model, tokenizer, prompt: str, completion: str) -> tuple[float, int]:
    """Summed log-probs of a completion after its prompt, and its token count:
    transformers alone, the text as one sequence ended by the end-of-text token."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    ids = tokenizer(prompt + completion)["input_ids"] + [tokenizer.eos_token_id]
    assert ids[:len(prompt_ids)] == prompt_ids  # the prompt ends in a newline: its tokens stay its own
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    picked = [logprobs[t - 1, ids[t]].item() for t in range(len(prompt_ids), len(ids))]
    return sum(picked), len(picked)


def independent_eval(policy_dir: Path, reference_dir: Path | None, rows: list[dict], beta: float, loss: str,
                     gamma: float = 0.0) -> dict:
    """Means over the pairs: DPO's sigmoid or ipo loss against `reference_dir`,
    or SimPO's (no reference, margin `gamma`)."""
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    models = {"policy": AutoModelForCausalLM.from_pretrained(policy_dir).eval()}
    if reference_dir is not None:
        models["reference"] = AutoModelForCausalLM.from_pretrained(reference_dir).eval()
    per_token = loss in ("ipo", "simpo")
    values = {k: [] for k in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen")}
    for row in rows:
        scored = {("reference", side): 0.0 for side in ("chosen", "rejected")}
        for side in ("chosen", "rejected"):
            for name, model in models.items():
                logp, count = completion_logps(model, tokenizer, row["prompt"], row[side])
                scored[name, side] = logp / count if per_token else logp
        chosen = beta * (scored["policy", "chosen"] - scored["reference", "chosen"])
        rejected = beta * (scored["policy", "rejected"] - scored["reference", "rejected"])
        logits = (chosen - rejected) / beta
        values["loss"].append({"sigmoid": lambda: math.log1p(math.exp(-beta * logits)),
                               "ipo": lambda: (logits - 1 / (2 * beta)) ** 2,
                               "simpo": lambda: math.log1p(math.exp(-(beta * logits - gamma)))}[loss]())
        values["rewards/chosen"].append(chosen)
        values["rewards/rejected"].append(rejected)
        values["rewards/accuracies"].append(float(chosen > rejected))
        values["logps/chosen"].append(scored["policy", "chosen"])
    return {name: sum(v) / len(v) for name, v in values.items()}


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo"])
def test_rewards_and_loss_equal_an_independent_computation(loss, models, tmp_path, env):
    """The first evaluation scores every held-out pair with the policy (--model)
    and, for DPO, a reference of other weights: under 2-process FSDP, each value
    is the mean of what transformers alone computes."""
    policy, reference = models
    data = data_dir(tmp_path / "data", conversational=False)
    run_dir = tmp_path / "run"
    method = (["--method", "simpo", "--simpo_gamma", "0.3"] if loss == "simpo" else
              ["--method", "dpo", "--dpo_loss", loss, "--reference_model", reference])
    check_ok(run_cli(["train", "--model", policy, *method, "--dpo_beta", "0.5", "--dataset", data, *QUIET,
                      "--max_steps", "1", "--output_dir", run_dir], env, mixed_precision="no", warm=True))
    first = json.loads((run_dir / "summary.json").read_text())["first_eval"]
    expected = independent_eval(policy, None if loss == "simpo" else reference,
                                read_jsonl(data / "validation.jsonl"), 0.5, loss, gamma=0.3)
    assert first["eval_loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen"):
        assert first[f"eval_{name}"] == pytest.approx(expected[name], rel=1e-5, abs=1e-5), name
    assert 0 < expected["rewards/accuracies"] < 1  # the reference differs: a real comparison


@pytest.fixture(scope="module")
@launches
def learnt(models, tmp_path_factory, env) -> dict[str, Path]:
    """Full and LoRA DPO of the chat model on a learnable preference (2-process
    FSDP, fp32), and LoRA SFT on the chosen answers for the state comparison."""
    policy, _ = models
    root = tmp_path_factory.mktemp("learnt")
    data = data_dir(root / "data", conversational=True, train=96, validation=32)
    sft_data = write_jsonl(root / "sft.jsonl", [{"messages": r["prompt"] + r["chosen"]}
                                                for r in read_jsonl(data / "train.jsonl")])
    common = ["--model", policy, *QUIET, "--max_steps", "16", "--warmup_steps", "0", "--lr_scheduler_type", "constant",
              "--checkpoint_every", "8"]
    runs = {"full": ["--method", "dpo", "--dataset", data, "--learning_rate", "3e-3"],
            "lora": ["--method", "dpo", "--peft", "lora", "--dataset", data, "--learning_rate", "3e-2"],
            "lora-sft": ["--peft", "lora", "--dataset", sft_data, "--learning_rate", "3e-2"]}
    dirs = {name: root / name for name in runs}
    for name, args in runs.items():
        check_ok(run_cli(["train", *common, *args, "--output_dir", dirs[name]], env, mixed_precision="no",
                         warm=True))
    return {**dirs, "data": data}


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_first_loss_is_ln2_and_the_preference_is_learnt(kind, learnt, models):
    run_dir = learnt[kind]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = train_rows(run_dir)
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at step 1
    assert rows[0]["rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert summary["first_eval"]["eval_rewards/accuracies"] == 0.0  # no reward yet: no pair ranked
    assert summary["last_eval"]["eval_rewards/accuracies"] >= 0.8
    assert summary["last_eval"]["eval_loss"] < math.log(2)
    assert summary["world_size"] == 2 and summary["method"] == "dpo"


def test_the_final_model_ranks_chosen_above_rejected_as_the_tool_reports(learnt, models, tmp_path):
    """The exported full-DPO model's implied rewards against the starting
    model, on every held-out pair, computed here with transformers alone."""
    policy, _ = models
    tokenizer = AutoTokenizer.from_pretrained(policy)
    final, start = (AutoModelForCausalLM.from_pretrained(d).eval() for d in (learnt["full"] / "final", policy))
    ranked = []
    for row in read_jsonl(learnt["data"] / "validation.jsonl"):
        rewards = {}
        for side in ("chosen", "rejected"):
            ids, prompt = (tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen),
                                     add_special_tokens=False)["input_ids"]
                           for messages, gen in ((row["prompt"] + row[side], False), (row["prompt"], True)))
            end = len(ids) - 1  # the newline after <|im_end|> is not a target
            with torch.no_grad():
                logps = [torch.log_softmax(m(torch.tensor([ids])).logits[0].double(), -1) for m in (final, start)]
            rewards[side] = sum(logps[0][t - 1, ids[t]] - logps[1][t - 1, ids[t]] for t in range(len(prompt), end))
        ranked.append(float(rewards["chosen"] > rewards["rejected"]))
    reported = json.loads((learnt["full"] / "summary.json").read_text())["last_eval"]["eval_rewards/accuracies"]
    assert sum(ranked) / len(ranked) == pytest.approx(reported, abs=1e-9)
    assert reported >= 0.8


def test_the_reference_is_sharded_or_is_the_base_without_adapters(learnt):
    full, lora, sft = (json.loads((learnt[k] / "summary.json").read_text()) for k in ("full", "lora", "lora-sft"))
    total = full["total_params"]
    assert full["reference_params_per_rank"] == full["local_params_per_rank"]
    assert all(abs(n - total / 2) < 0.01 * total for n in full["reference_params_per_rank"])
    # What estimate-memory --method dpo plans for the reference on each rank (fp32 weights).
    from finetune.memory import estimate, model_shape

    planned = {e.strategy: e for e in estimate(model_shape(full["model"]), 2, 4, 64, mixed_precision="no",
                                               sequences_per_row=2, reference_copy=True)}
    assert planned["FSDP full shard"].reference == 4 * max(full["reference_params_per_rank"])
    assert planned["DDP"].reference == planned["DeepSpeed ZeRO-2"].reference == 4 * total
    assert planned["DeepSpeed ZeRO-3"].reference == planned["FSDP full shard"].reference
    assert lora["reference"] == "the base, adapters off" and lora["reference_params_per_rank"] is None
    # No second copy under LoRA: what each rank holds is LoRA SFT's.
    for dpo_bytes, sft_bytes in zip(lora["state_bytes_per_rank"], sft["state_bytes_per_rank"]):
        assert abs(dpo_bytes - sft_bytes) <= 0.05 * sft_bytes


@pytest.mark.slow
def test_a_dpo_run_resumes_exactly(learnt, tmp_path, env):
    """LoRA DPO resumed from its step-8 checkpoint: steps 9 to 16 as the uninterrupted run logged them."""
    run_dir = tmp_path / "resumed"
    check_ok(run_cli(["train", "--config", learnt["lora"] / "run_config.yaml", "--output_dir", run_dir,
                      "--resume_from_checkpoint", learnt["lora"] / "checkpoints" / "step_000008"], env,
                     mixed_precision="no", warm=True))
    resumed, uninterrupted = ({r["step"]: r for r in train_rows(d)} for d in (run_dir, learnt["lora"]))
    assert sorted(resumed) == list(range(9, 17))
    for step in resumed:
        for name in ("loss", "rewards/margins", "logps/chosen"):
            assert resumed[step][name] == pytest.approx(uninterrupted[step][name], abs=1e-6), (step, name)
    # Exported offline from its last checkpoint: the adapters merged into the base, as final/ holds them.
    check_ok(run_in_process("export", run_dir, "--output", tmp_path / "export"))
    exported, final = (load_file(d / "model.safetensors") for d in (tmp_path / "export", run_dir / "final"))
    assert exported.keys() == final.keys()
    for name, tensor in final.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_full_dpo_resume_against_another_reference_is_refused(learnt, models, tmp_path):
    """Full DPO compares with a frozen copy of --model: a resume naming other
    weights, or the same dir with its weights replaced, stops in one line
    before anything is written."""
    policy, other = models
    replaced = tmp_path / "policy"
    shutil.copytree(policy, replaced)
    weights = load_file(replaced / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 0.01
    save_file(weights, replaced / "model.safetensors", metadata={"format": "pt"})
    for model in (other, replaced):
        run_dir = tmp_path / f"run-{model.name}"
        shutil.copytree(learnt["full"], run_dir)
        before = snapshot(run_dir)
        proc = run_in_process("resume", run_dir, "--model", model, "--max_steps", "20")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"error: --model {model} is not the reference {run_dir}"), lines
        assert snapshot(run_dir) == before


@pytest.mark.slow
def test_ddp_and_zero_take_the_same_steps(learnt, tmp_path, env):
    """Full DPO under DDP and ZeRO-2 (a whole frozen reference on each rank, as
    the parameters are) and ZeRO-3 (a partitioned reference in an engine of its
    own), and LoRA DPO under ZeRO-3 (the partitioned base, adapters off), log
    the FSDP runs' first steps."""
    full = [*json_args(learnt, "full"), "--max_steps", "4"]
    lora = [*json_args(learnt, "lora"), "--max_steps", "4"]
    cases = [("ddp", full, "ddp.yaml", "full"), ("zero2", full, "zero2.yaml", "full"),
             ("zero3", full, "zero3.yaml", "full"), ("zero3-lora", lora, "zero3.yaml", "lora")]
    procs = run_cli_together([(["train", *args, "--output_dir", tmp_path / name], dict(config=config, mixed_precision="no"))
                              for name, args, config, _ in cases[:3]], env)
    procs.append(run_cli(["train", *lora, "--output_dir", tmp_path / "zero3-lora"], env, config="zero3.yaml",
                         mixed_precision="no", warm=True))
    for proc, (name, _, _, like) in zip(procs, cases):
        check_ok(proc)
        steps, expected = ({r["step"]: r for r in train_rows(d)} for d in (tmp_path / name, learnt[like]))
        assert sorted(steps) == [1, 2, 3, 4]
        for step in steps:
            for metric in ("loss", "rewards/chosen", "rewards/rejected"):
                assert steps[step][metric] == pytest.approx(expected[step][metric], rel=1e-4, abs=1e-5), (name, step)
    reference = json.loads((tmp_path / "zero3" / "summary.json").read_text())["reference_params_per_rank"]
    total = json.loads((learnt["full"] / "summary.json").read_text())["total_params"]
    assert all(abs(n - total / 2) < 0.05 * total for n in reference), reference  # partitioned, as the policy


@pytest.mark.slow
def test_precomputed_reference_log_probs_take_the_same_steps_and_are_reused(learnt, tmp_path, env):
    """--precompute_reference: one pass before training, cached; full and LoRA
    DPO then log the steps of the runs that held a reference, and hold none."""
    full, lora = ([*json_args(learnt, name), "--max_steps", "4", "--precompute_reference"] for name in ("full", "lora"))
    first = [run_cli(["train", *args, "--output_dir", tmp_path / name], env, mixed_precision="no", warm=True)
             for args, name in ((lora, "lora"), (full, "full"))]
    # The LoRA run scores the pairs (the base, adapters off, read from its files shard by shard first), then
    # trains sharded; the full run's reference is the same model: it reads them.
    for proc, name, says in zip(first, ("lora", "full"), ("computed once, cached in", "read from")):
        check_ok(proc)
        assert f"reference log-probs of 128 pairs {says}" in proc.stdout, proc.stdout[-2000:]
        steps, expected = ({r["step"]: r for r in train_rows(d)} for d in (tmp_path / name, learnt[name]))
        assert sorted(steps) == [1, 2, 3, 4]
        for step in steps:
            for metric in ("loss", "rewards/chosen", "rewards/rejected"):
                assert steps[step][metric] == pytest.approx(expected[step][metric], rel=1e-4, abs=1e-5), (name, step)
        assert json.loads((tmp_path / name / "summary.json").read_text())["reference_params_per_rank"] is None
    # Scores of the right shape at that name, through a link, are not these pairs' own: scored again.
    cached = Path(re.search(r"computed once, cached in (\S+)", first[0].stdout).group(1))

    save_file({"logps": -torch.ones_like(load_file(str(cached))["logps"])}, str(tmp_path / "forged.safetensors"),
              metadata={"key": cached.stem})
    cached.unlink()
    cached.symlink_to(tmp_path / "forged.safetensors")
    again = run_cli(["train", *full, "--output_dir", tmp_path / "again"], env, mixed_precision="no", warm=True)
    check_ok(again)
    assert "reference log-probs of 128 pairs computed once, cached in" in again.stdout and not cached.is_symlink()
    steps, expected = ({r["step"]: r["loss"] for r in train_rows(d)} for d in (tmp_path / "again", learnt["full"]))
    assert sorted(steps) == [1, 2, 3, 4] and steps == pytest.approx({s: expected[s] for s in steps}, rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_qlora_dpo_starts_at_ln2_and_moves_the_rewards(tmp_path, env):
    """QLoRA's code path on CPU (as test_lora runs it): the reference is the
    4-bit base with the adapters off."""
    pytest.importorskip("torchao")
    from sft_models import chat_tokenizer, conversations
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = chat_tokenizer([m["content"] for row in conversations(200) for m in row["messages"]])
    torch.manual_seed(0)
    model_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=256, n_layer=2, n_head=4, n_positions=128,
                               bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    run_dir = tmp_path / "run"
    check_ok(run_cli(["train", "--model", model_dir, "--method", "dpo", "--peft", "qlora", "--dataset",
                      data_dir(tmp_path / "data", conversational=False), *QUIET, "--max_steps", "4",
                      "--learning_rate", "3e-2", "--output_dir", run_dir],
                     {**env, "FINETUNE_QLORA_ON_CPU": "1"}, mixed_precision="no", warm=True))
    rows = train_rows(run_dir)
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert rows[-1]["rewards/margins"] > 0 and all(math.isfinite(r["loss"]) for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["peft"] == "qlora" and summary["reference"] == "the base, adapters off"


def json_args(learnt: dict, name: str) -> list[str]:
    """The options a learnt run was started with, from its run_config.yaml."""
    import yaml

    config = yaml.safe_load((learnt[name] / "run_config.yaml").read_text())
    keep = ("model", "objective", "peft", "dataset", "block_size", "per_device_batch_size", "learning_rate",
            "lr_scheduler_type", "warmup_steps", "sample_prompt", "log_format")
    return [str(part) for key in keep if key in config for part in (f"--{key}", config[key])]


# --- bad input ------------------------------------------------------------------------------------

def one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    return lines[-1]


def test_bad_preference_input_is_one_line(models, tmp_path):
    policy, reference = models
    data = data_dir(tmp_path / "pairs", conversational=False, train=8, validation=4)
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "plain text"}\n' * 8)
    same = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "q\n", "chosen": "a b", "rejected": "a b"}] * 8)
    base = ["train", "--model", str(policy), *QUIET, "--max_steps", "1"]
    cases = [
        (["--dataset", str(data)], "holds preference pairs (chosen/rejected), which --method sft"),
        (["--method", "dpo", "--dataset", str(text)], "trains on preference pairs (chosen/rejected), and --dataset"),
        (["--method", "dpo", "--dataset", str(same)], ": chosen and rejected are the same"),
        (["--dpo_loss", "ipo", "--dataset", str(data)], "--dpo_loss is read by --method dpo"),
        (["--method", "dpo", "--peft", "lora", "--reference_model", str(reference), "--dataset", str(data)],
         "no --reference_model to load"),
        (["--method", "simpo", "--data_format", "chat", "--dataset", str(data)], "trains on preference pairs"),
    ]
    for extra, expected in cases:
        out = tmp_path / "out"
        line = one_line(run_in_process(*base, *extra, "--output_dir", str(out)))
        assert expected in line and "; " in line, line
        assert not out.exists(), extra
