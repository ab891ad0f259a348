"""Fast, single-process tests of the pieces: config, CLI, data, schedule, model dir writing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from datasets import Dataset, DatasetDict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from conftest import REPO
from finetune.config import TrainConfig, config_fields, load_config
from finetune.data.text import load_raw_text, tokenize_and_group
from finetune.data.tokenizer import train_bpe_tokenizer
from finetune.errors import UsageError
from finetune.model_dir import write_model_dir
from finetune.config import LR_SCHEDULERS
from finetune.optim import LRSchedule, build_scheduler

# --- config ---------------------------------------------------------------------------------------


def test_yaml_config_is_overridden_by_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("max_steps: 7\nlearning_rate: 0.01\nmodel: small-gpt2\n")
    cfg = load_config(path, {"max_steps": "9"})
    assert (cfg.max_steps, cfg.learning_rate, cfg.model) == (9, 0.01, "small-gpt2")


def test_unknown_config_key_suggests_the_right_one(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rte: 0.01\n")
    with pytest.raises(UsageError, match="unknown key 'learning_rte'.*did you mean 'learning_rate'"):
        load_config(path, {})


@pytest.mark.parametrize("overrides, problem", [
    ({"max_steps": "-1"}, "--max_steps must be >= 0"),
    ({"block_size": "0"}, "--block_size must be > 0"),
    ({"validation_split": "1.5"}, "--validation_split must be between 0 and 1"),
    ({"learning_rate": "abc"}, "learning_rate: expected float"),
    ({"max_steps": "2.5"}, "max_steps: expected int"),
    ({"task": "translation"}, "--task 'translation' is not supported"),
])
def test_bad_values_are_rejected_before_anything_runs(overrides, problem):
    with pytest.raises(UsageError, match=problem):
        load_config(None, overrides)


def test_saved_config_loads_back_identically(tmp_path):
    cfg = load_config(None, {"max_steps": "11", "overwrite": "true"}).resolved()
    cfg.save(tmp_path / "run_config.yaml")
    assert load_config(tmp_path / "run_config.yaml", {}) == cfg


# --- CLI ------------------------------------------------------------------------------------------


def _cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "finetune", *args], capture_output=True, text=True, cwd=cwd,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})


def test_train_help_lists_every_option_with_its_default():
    out = _cli("train", "--help").stdout
    for f in config_fields():
        assert f"--{f.name}" in out, f.name
    assert out.count("(default:") == len(config_fields())


def test_report_to_help_names_every_tracker_it_accepts():
    from finetune.config import REPORTERS

    out = _cli("train", "--help").stdout
    text = " ".join(out[out.index("  --report_to STR"):].split("  --")[1].split())  # its help, wrapped lines joined
    assert all(name in text for name in REPORTERS), text


def test_help_is_grouped_and_offers_only_what_each_command_accepts():
    from finetune.cli import OPTION_GROUPS

    grouped = [name for names in OPTION_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in config_fields())  # every option in exactly one group
    top = _cli("--help").stdout
    assert "finetune configs" in top and "UsageError" not in top and "dispatch" not in top
    train = _cli("train", "--help").stdout
    headings = [line.rstrip(":") for line in train.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert headings[:8] == ["options", "model", "data", "training", "LoRA", "preference tuning",
                            "checkpoints and outputs", "evaluation and logging"]
    assert "--config FILE.yaml" in train and "--config " not in _cli("resume", "--help").stdout


def test_console_exit_code_2_and_one_line_for_bad_input(tmp_path):
    """A real process (the other bad inputs are in test_errors.py, in-process)."""
    proc = _cli("train", "--max_step", "3", "--output_dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error: unknown option --max_step; did you mean --max_steps?; see `finetune train --help`"
    assert not (tmp_path / "run").exists()


def test_top_level_help_lists_the_commands():
    out = _cli("--help").stdout
    for command in ("train", "resume", "export", "generate", "evaluate", "estimate-memory"):
        assert command in out


# --- schedule -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in LR_SCHEDULERS if n != "step"])
def test_every_schedule_is_transformers_own_with_the_run_s_warmup(name):
    from transformers import get_scheduler

    total, ratio = 40, 0.1
    cfg = load_config(None, {"model": "some/pretrained-model", "lr_scheduler_type": name, "warmup_ratio": ratio,
                             "min_lr_ratio": 0.2, "learning_rate": 0.01})
    ours_opt, theirs_opt = (torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01) for _ in range(2))
    schedule = LRSchedule.for_config(build_scheduler(ours_opt, cfg, total), ours_opt, cfg)
    specific = {"min_lr_rate": 0.2} if name == "cosine_with_min_lr" else {}
    theirs = get_scheduler(name, theirs_opt, num_warmup_steps=4, num_training_steps=total,  # 10% of 40 steps
                           scheduler_specific_kwargs=specific)
    ours_lrs, their_lrs = [], []
    for _ in range(total):
        ours_lrs.append(schedule.lr)
        their_lrs.append(theirs_opt.param_groups[0]["lr"])
        ours_opt.step(), theirs_opt.step()
        schedule.step_done()
        theirs.step()
        schedule.epoch_done()  # per-step schedules ignore epochs
    assert ours_lrs == their_lrs
    assert len(set(ours_lrs)) == 1 if name == "constant" else len(set(ours_lrs)) > 3


def test_a_longer_resumed_run_takes_the_new_schedule_from_its_next_step():
    cfg = load_config(None, {"model": "some/pretrained-model"})  # linear, 3% warmup

    def schedule(total: int) -> LRSchedule:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
        return LRSchedule.for_config(build_scheduler(optimizer, cfg, total), optimizer, cfg)

    def run(s: LRSchedule, steps: int) -> None:
        for _ in range(steps):
            s.optimizer.step()
            s.step_done()

    old, longer = schedule(30), schedule(40)
    run(old, 20)
    run(longer, 20)
    resumed = schedule(40)  # a resume with --max_steps 40 of a 30-step run stopped at step 20
    resumed.scheduler.load_state_dict(old.scheduler.state_dict())
    resumed.optimizer.load_state_dict(old.optimizer.state_dict())
    assert resumed.lr == old.lr != longer.lr
    note = resumed.follow_new_length(20)
    assert resumed.lr == pytest.approx(longer.lr) and f"{longer.lr:.3e}" in note and f"{old.lr:.3e}" in note
    run(resumed, 5)
    run(longer, 5)
    assert resumed.lr == pytest.approx(longer.lr)


def test_the_lectures_step_schedule_halves_once_per_epoch():
    cfg = load_config(None, {"task": "image-classification"})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
    schedule = LRSchedule.for_config(build_scheduler(optimizer, cfg, 100), optimizer, cfg)
    lrs = []
    for epoch in range(3):
        for _ in range(5):
            lrs.append(schedule.lr)
            optimizer.step()
            schedule.step_done()
        schedule.epoch_done()
    assert lrs == [1e-2] * 5 + [5e-3] * 5 + [2.5e-3] * 5


def test_defaults_follow_what_the_model_is():
    scratch, tuned = load_config(None, {"model": "tiny-gpt2"}), load_config(None, {"model": "path/to/pretrained"})
    assert (scratch.learning_rate, scratch.weight_decay, scratch.adam_beta2, scratch.lr_scheduler_type) == \
        (1e-3, 0.1, 0.95, "cosine_with_min_lr")
    assert (tuned.learning_rate, tuned.weight_decay, tuned.adam_beta2, tuned.lr_scheduler_type, tuned.warmup_ratio) == \
        (5e-5, 0.0, 0.999, "linear", 0.03)
    assert load_config(None, {"model": "path/to/pretrained", "learning_rate": 1e-4}).learning_rate == 1e-4


# --- data -----------------------------------------------------------------------------------------


def test_builtin_corpus_is_real_text_and_deterministic(tmp_path, monkeypatch):
    from finetune.data.builtin import build_stdlib_corpus

    built = []
    for cache in ("first", "second"):  # two independent builds, nothing shared
        monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / cache))
        built.append(build_stdlib_corpus())
    assert built[0] != built[1] and built[0].read_bytes() == built[1].read_bytes()
    docs = [json.loads(line)["text"] for line in built[0].read_text().splitlines()]
    assert len(docs) > 1000 and sum(map(len, docs)) > 500_000
    words = " ".join(docs[:200]).split()
    assert sum(w.lower() in {"the", "a", "of", "is", "to"} for w in words) > 0.05 * len(words)
    import argparse

    assert argparse.__doc__.strip() in docs  # module docstrings are read from the source files


def test_blocks_are_exact_with_end_of_text_between_documents():
    texts = ["alpha beta gamma delta", "epsilon zeta eta theta", "iota kappa lambda mu"] * 20
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    raw = DatasetDict(train=Dataset.from_dict({"text": texts}), validation=Dataset.from_dict({"text": texts[:6]}))
    blocks = tokenize_and_group(raw, tokenizer, block_size=16)
    stream = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    assert len(blocks["train"]) == len(stream) // 16
    assert blocks["train"][0]["input_ids"].tolist() == stream[:16]
    assert all(len(ids) == 16 for ids in blocks["train"]["input_ids"])


def test_a_wrapped_txt_file_is_a_document_per_paragraph_with_its_line_breaks(tmp_path):
    import textwrap

    words = [f"word{i}" for i in range(400)]
    paragraphs = [textwrap.fill(" ".join(words[i:i + 45]), 72) for i in range(0, 360, 45)]
    assert all(p.count("\n") >= 3 for p in paragraphs)  # wrapped at 72 columns
    (tmp_path / "wrapped.txt").write_text("\n\n".join(paragraphs) + "\n\n\n")
    tokenizer = train_bpe_tokenizer(paragraphs * 3, vocab_size=400)
    eos = tokenizer.eos_token_id

    def stream(sample_by: str) -> list[int]:
        raw = load_raw_text(str(tmp_path / "wrapped.txt"), "text", 0.0, 0, sample_by=sample_by)
        return [t for block in tokenize_and_group(raw, tokenizer, block_size=8)["train"]["input_ids"]
                for t in block.tolist()]

    by_paragraph = [t for p in paragraphs for t in tokenizer(p)["input_ids"] + [eos]]
    assert stream("paragraph") == by_paragraph[:len(by_paragraph) // 8 * 8]
    assert stream("paragraph").count(eos) == len(paragraphs) - (len(by_paragraph) % 8 > 0)
    lines = [line for p in paragraphs for line in p.splitlines()]
    by_line = [t for line in lines for t in tokenizer(line)["input_ids"] + [eos]]  # the old layout
    assert stream("line") == by_line[:len(by_line) // 8 * 8]
    whole = tokenizer("\n\n".join(paragraphs))["input_ids"] + [eos]
    assert stream("document") == whole[:len(whole) // 8 * 8]


def test_text_shorter_than_one_block_is_a_clear_error():
    tokenizer = train_bpe_tokenizer(["a few words of text"] * 5, vocab_size=280)
    raw = DatasetDict(train=Dataset.from_dict({"text": ["a few words"]}), validation=Dataset.from_dict({"text": ["a few"]}))
    with pytest.raises(UsageError, match="fewer than one block of --block_size 64"):
        tokenize_and_group(raw, tokenizer, block_size=64)


def test_a_preset_tokenizer_is_trained_once_per_text_and_its_tokens_cached_across_run_dirs(tmp_path, monkeypatch):
    import datasets

    import finetune.data.tokenizer as tokenizer_module
    from finetune.data.tokenizer import load_preset_tokenizer, save_bpe_tokenizer

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    texts = [f"document {i} says alpha beta gamma {i * 7} delta" for i in range(300)]
    DatasetDict(train=Dataset.from_dict({"text": texts}),
                validation=Dataset.from_dict({"text": texts[:20]})).save_to_disk(tmp_path / "raw")
    raw = datasets.load_from_disk(str(tmp_path / "raw"))  # file-backed: maps write cache files

    save_bpe_tokenizer(raw["train"], 320, tmp_path / "run_a" / "tokenizer")

    def no_training(*args, **kwargs):
        raise AssertionError("trained again")
    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", no_training)
    save_bpe_tokenizer(raw["train"], 320, tmp_path / "run_b" / "tokenizer")  # the same text: from the cache
    trained = train_bpe_tokenizer(texts, 320)
    trained.save_pretrained(tmp_path / "fresh")
    for run in ("run_a", "run_b"):
        assert (tmp_path / run / "tokenizer" / "tokenizer.json").read_text() == \
            (tmp_path / "fresh" / "tokenizer.json").read_text()
    with pytest.raises(AssertionError, match="trained again"):
        save_bpe_tokenizer(raw["train"], 330, tmp_path / "run_c" / "tokenizer")  # another vocabulary size
    with pytest.raises(AssertionError, match="trained again"):
        save_bpe_tokenizer(raw["train"].select(range(100)), 320, tmp_path / "run_c" / "tokenizer")  # other text

    # The second run dir's tokenizer finds the first one's tokens in datasets' cache.
    blocks = [tokenize_and_group(raw, load_preset_tokenizer(tmp_path / run / "tokenizer", "tiny-gpt2"), 16)
              for run in ("run_a", "run_b")]
    assert blocks[0]["train"].cache_files and blocks[0]["train"].cache_files == blocks[1]["train"].cache_files
    assert blocks[0]["train"]["input_ids"][:3].tolist() == blocks[1]["train"]["input_ids"][:3].tolist()


@pytest.mark.parametrize("deepspeed_run", [False, True])
def test_only_a_deepspeed_run_imports_deepspeed_when_accelerate_unwraps(deepspeed_run):
    pytest.importorskip("deepspeed")
    script = """
import sys
import torch
from accelerate.utils import extract_model_from_parallel
from finetune.backends import requested_backend
requested_backend().import_libraries()
extract_model_from_parallel(torch.nn.Linear(2, 2))  # what Accelerate's prepare and unwrap_model call
print("deepspeed" in sys.modules)
"""
    env = {**os.environ, "ACCELERATE_USE_DEEPSPEED": "true" if deepspeed_run else "false"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == str(deepspeed_run)


@pytest.mark.parametrize("kept_out", [False, True])
def test_transformers_model_code_imports_torchao_unless_kept_out(kept_out):
    """Guards finetune.cli.keep_torchao_out_of_transformers from both sides: the
    import it saves happens without it, and not with it."""
    pytest.importorskip("torchao")
    script = f"""
import sys
from finetune.cli import keep_torchao_out_of_transformers
if {kept_out}:
    keep_torchao_out_of_transformers()
from transformers import GPT2Config, GPT2LMHeadModel
GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
print("torchao" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == str(not kept_out)


def test_local_jsonl_needs_the_text_column(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"document {i}"}) for i in range(10)))
    with pytest.raises(UsageError, match="has no column 'text' .*columns: body.*--text_column"):
        load_raw_text(str(path), "text", 0.1, 0)
    raw = load_raw_text(str(path), "body", 0.2, 0)
    assert len(raw["train"]) == 8 and len(raw["validation"]) == 2 and raw["train"].column_names == ["text"]


def test_empty_data_file_is_a_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UsageError, match="is empty"):
        load_raw_text(str(tmp_path / "empty.txt"), "text", 0.1, 0)


# --- writing model dirs ---------------------------------------------------------------------------


def _tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=300,
                                      bos_token_id=0, eos_token_id=0))


def test_model_dir_stores_tied_weights_once_and_loads_tied(tmp_path):
    model = _tiny_model()
    write_model_dir(model.state_dict(), model.config, tmp_path / "out")
    stored = load_file(tmp_path / "out" / "model.safetensors")
    assert "lm_head.weight" not in stored and "transformer.wte.weight" in stored
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    ids = torch.arange(10).view(1, 10)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


def test_large_model_dir_is_split_with_an_index(tmp_path):
    model = _tiny_model()
    write_model_dir(model.state_dict(), model.config, tmp_path / "out", max_shard_size=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_model_dir_refuses_a_non_empty_target_and_leaves_it_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    model = _tiny_model()
    with pytest.raises(UsageError, match="exists and is not empty; pass --overwrite"):
        write_model_dir(model.state_dict(), model.config, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_bf16_model_dir_is_half_the_size(tmp_path):
    model = _tiny_model()
    write_model_dir(model.state_dict(), model.config, tmp_path / "fp32")
    fp32 = (tmp_path / "fp32" / "model.safetensors").stat().st_size
    for dtype in ("bfloat16", "float16"):
        write_model_dir(model.state_dict(), model.config, tmp_path / dtype, dtype=dtype)
        assert 0.45 < (tmp_path / dtype / "model.safetensors").stat().st_size / fp32 < 0.55
        assert AutoModelForCausalLM.from_pretrained(tmp_path / dtype).dtype == getattr(torch, dtype)


def test_config_defaults_are_valid():
    TrainConfig().validate()


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


def test_estimate_memory_of_a_non_transformer_is_one_line(capsys):
    from finetune.cli import main

    assert main(["estimate-memory", "--model", "lecture-cnn"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: estimate-memory models transformer causal LMs")
    assert "lecture-cnn is an image-classification model" in err


# --- relaunch -------------------------------------------------------------------------------------

RECORDED = {"distributed_type": "FSDP", "num_processes": 2, "num_machines": 1,
            "launcher_options": ["--num_processes", "2", "--mixed_precision", "no"],
            "accelerate_config": {"distributed_type": "FSDP", "num_processes": 2}}


def test_relaunch_replays_the_recorded_launch_with_a_new_process_count(tmp_path):
    from finetune.launch import relaunch_command

    config = tmp_path / "accelerate_config.yaml"
    command = relaunch_command(tmp_path, RECORDED, ["resume", "RUN", "--max_steps", "9"], 3, config)
    start = command.index("accelerate.commands.launch") + 1
    finetune = command.index("-m", start)
    launch = command[start:finetune]
    assert launch[:2] == ["--config_file", str(config)]
    assert launch.count("--num_processes") == 1 and launch[launch.index("--num_processes") + 1] == "3"
    assert launch[launch.index("--mixed_precision") + 1] == "no" and "--main_process_port" in launch
    assert command[finetune:] == ["-m", "finetune", "resume", "RUN", "--max_steps", "9"]
    # A run started without accelerate launch resumes in place; one over several machines is refused.
    assert relaunch_command(tmp_path, {"distributed_type": "NO", "num_processes": 1}, [], None, config) is None
    with pytest.raises(UsageError, match="ran on 2 machines; resume it the way it was launched"):
        relaunch_command(tmp_path, {**RECORDED, "num_machines": 2}, [], None, config)


def test_a_relaunch_uses_the_recorded_deepspeed_json_not_the_file(tmp_path):
    """A DeepSpeed run records the JSON its accelerate config named; the
    relaunch points the recorded config at a copy of that content."""
    from pathlib import Path

    import yaml

    from finetune.launch import write_recorded_configs

    settings = {"zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}
    launch = {**RECORDED, "accelerate_config": {"distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_config_file": "gone/zero3.json", "zero3_init_flag": False}}, "deepspeed_config": settings}
    config = yaml.safe_load(write_recorded_configs(launch, tmp_path).read_text())
    named = Path(config["deepspeed_config"]["deepspeed_config_file"])
    assert named.parent == tmp_path and json.loads(named.read_text()) == settings
    assert config["deepspeed_config"]["zero3_init_flag"] is False and config["distributed_type"] == "DEEPSPEED"
    assert yaml.safe_load(write_recorded_configs(RECORDED, tmp_path).read_text()) == RECORDED["accelerate_config"]


@pytest.mark.parametrize("left, launcher_code, expected", [
    ({}, 0, 0),                              # nothing failed
    ({0: 2, 1: 2}, 1, 2),                    # bad input every rank found: the workers' code, not the launcher's 1
    ({0: 0, 1: 130}, 1, 130),                # rank 1 stopped by a signal
    ({1: 2}, 1, 2),                          # rank 0 died without a word
    ({}, 1, 1),                              # no rank left a code: the launcher's
])
def test_a_relaunch_exits_with_the_workers_code(tmp_path, left, launcher_code, expected):
    from finetune.launch import workers_exit_code

    for rank, code in left.items():
        (tmp_path / f"rank{rank}").write_text(str(code))
    assert workers_exit_code(tmp_path, launcher_code) == expected


# --- checkpoints: tied weights ----------------------------------------------------------------------

@pytest.mark.parametrize("family, tied", [("llama", True), ("llama", False), ("qwen2", True)])
def test_a_tied_parameter_is_saved_under_one_name_and_loads_back_tied(family, tied):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from finetune.checkpoint import StoredState

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    config = config_class(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = model_class(config)
    trained = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    StoredState(model).active = True
    saved = model.state_dict()
    assert ("lm_head.weight" in saved) is not tied and "model.embed_tokens.weight" in saved
    assert set(trained) - set(saved) == ({"lm_head.weight"} if tied else set())

    torch.manual_seed(1)
    fresh = model_class(config)
    StoredState(fresh).active = True
    fresh.load_state_dict(saved)  # strict: the missing name is the tied one, restored from its first name
    assert (fresh.lm_head.weight is fresh.model.embed_tokens.weight) is tied
    for name, tensor in fresh.named_parameters(remove_duplicate=False):
        assert torch.equal(tensor, trained[name]), name


def test_fsdp1_checkpoints_keep_every_parameter_name():
    """FSDP1's state-dict hooks run after the wrapped model's and check that every
    parameter is still there, so its checkpoints leave nothing out; the others do."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.backends import REGISTRY
    from finetune.checkpoint import StoredState

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    for backend in REGISTRY:
        model = LlamaForCausalLM(config)
        model.model.norm.weight.requires_grad_(False)  # a frozen parameter, as a base under adapters
        StoredState(model, leave_out=backend.checkpoints_leave_out_stored_state).active = True
        left_out = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(model.state_dict())
        expected = set() if backend.__name__ == "FSDP1" else {"lm_head.weight", "model.norm.weight"}
        assert left_out == expected, backend.__name__


def test_a_lora_checkpoint_holds_the_adapters_only_and_loads_them_into_the_live_base():
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.checkpoint import StoredState
    from finetune.peft import lora

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    base_state = {name: t.clone() for name, t in base.state_dict().items()}
    model = lora.add_adapters(base, lora.lora_config(4, 8.0, 0.0, "all-linear"))
    with torch.no_grad():  # trained adapters: B is no longer zero
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.normal_()
    trained = {name: t.clone() for name, t in model.state_dict().items()}
    stored = StoredState(model)
    assert len(model.state_dict()) == len(trained)  # inactive: the whole state, as the end-of-run gather needs
    stored.active = True
    saved = model.state_dict()
    assert saved and all(".lora_" in name for name in saved)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(saved)

    torch.manual_seed(1)
    fresh_base = LlamaForCausalLM(config)
    fresh_base.load_state_dict(base_state)  # the base, read from --model
    fresh = lora.add_adapters(fresh_base, lora.lora_config(4, 8.0, 0.0, "all-linear"))
    StoredState(fresh).active = True
    fresh.load_state_dict(saved)  # strict: every frozen name comes from the live model
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def test_own_shards_read_what_from_pretrained_loads(tmp_path):
    """A GPT-2 stored as the Hub's gpt2 is (no `transformer.` prefix, the tied
    head left out) and a GPT-NeoX (stored `embed_out`, loaded as `lm_head`):
    every tensor read from the files equals from_pretrained's, and a file
    whose names transformers would not load is left to from_pretrained."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig

    from finetune.shard_loading import OwnShards
    from finetune.models import placeholder_model

    torch.manual_seed(0)
    for config in (GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32),
                   GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 vocab_size=64, max_position_embeddings=32)):
        path = tmp_path / config.model_type
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        if config.model_type == "gpt2":
            stored = load_file(path / "model.safetensors")
            save_file({k.removeprefix("transformer."): v for k, v in stored.items()}, path / "model.safetensors",
                      metadata={"format": "pt"})
        expected = AutoModelForCausalLM.from_pretrained(path).state_dict()
        own = OwnShards.for_model(str(path), config, AutoModelForCausalLM, trust_remote_code=False)
        assert own is not None
        model = placeholder_model(config, AutoModelForCausalLM, torch.float32, trust_remote_code=False)
        own.fill(model)
        got = model.state_dict()
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight or config.model_type != "gpt2"

    stored = load_file(tmp_path / "gpt2" / "model.safetensors")
    save_file({"renamed." + k: v for k, v in stored.items()}, tmp_path / "gpt2" / "model.safetensors")
    assert OwnShards.for_model(str(tmp_path / "gpt2"), config=GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64,
                                                                        n_positions=32),
                               auto_class=AutoModelForCausalLM, trust_remote_code=False) is None


def test_bf16_loaded_weights_held_in_fp32_without_writing_the_placeholders(tmp_path):
    """--model_dtype bfloat16 under mixed precision: the trainable parameters
    are fp32 before sharding (as Accelerate would upcast them), an unwritten
    placeholder stays unwritten (no fp32 model per rank), and the rows read
    into it are the files' values rounded to bf16, as from_pretrained loads them."""
    from transformers import LlamaConfig

    from finetune.host_memory import resident_bytes
    from finetune.models import placeholder_model, upcast_trainable
    from finetune.shard_loading import OwnShards

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, max_position_embeddings=32)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")  # fp32 files
    files = load_file(tmp_path / "llama" / "model.safetensors")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).state_dict()
    model = placeholder_model(config, AutoModelForCausalLM, torch.bfloat16, trust_remote_code=False)
    upcast_trainable(model, written=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    OwnShards.for_model(str(tmp_path / "llama"), config, AutoModelForCausalLM, False, torch.bfloat16).fill(model)
    got = model.state_dict()
    assert all(torch.equal(got[k], expected[k].float()) for k in expected)
    assert any(not torch.equal(got[k], files[k]) for k in files)  # rounded through bf16 indeed

    big = placeholder_model(LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                                        num_attention_heads=8, vocab_size=1024), AutoModelForCausalLM, torch.bfloat16,
                            trust_remote_code=False)  # 0.4 GB in fp32
    before = resident_bytes()
    upcast_trainable(big, written=False)
    assert resident_bytes() - before < 50 * 2**20
    assert all(p.dtype == torch.float32 for p in big.parameters())


def test_merged_weights_equal_peft_merge_and_unload():
    """The final save's merge, tensor by tensor, gives exactly what peft's
    merge_and_unload gives: GPT-2's Conv1D (fan_in_fan_out) and Llama's Linear,
    with adapters that have trained (B nonzero)."""
    import copy

    from transformers import LlamaConfig

    from finetune.model_dir import Weights
    from finetune.peft.lora import add_adapters, lora_config, merged_weights

    torch.manual_seed(0)
    for base in (GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)),
                 AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                              num_attention_heads=2, vocab_size=64))):
        model = add_adapters(base, lora_config(4, 8, 0.0, "all-linear"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_()
        live = model.state_dict()
        before = {n: t.clone() for n, t in live.items()}
        weights = merged_weights({n: (t.shape, t.dtype) for n, t in live.items()},
                                 Weights.in_memory(live).fetch, dict(model.named_modules()))
        expected = copy.deepcopy(model).merge_and_unload().state_dict()
        assert set(weights.specs) == set(expected)
        got = weights.fetch(list(weights.specs))
        assert all(torch.equal(got[n], expected[n]) for n in expected)
        assert all(torch.equal(model.state_dict()[n], before[n]) for n in before)  # the live model is untouched


def test_shards_that_do_not_partition_the_model_stop_the_run():
    """Each rank holding everything (a silent fallback) is refused; padded ZeRO-3 partitions are not."""
    from finetune.backends.base import ShardReport, check_partition
    from finetune.errors import NotDistributed

    check_partition(ShardReport(total_params=100, local_params_per_rank=[52, 52]), "ZeRO-3 partitions")
    for per_rank in ([100, 100], [50, 40]):
        with pytest.raises(NotDistributed, match="do not partition the model.*refusing to train unsharded"):
            check_partition(ShardReport(total_params=100, local_params_per_rank=per_rank), "FSDP shards")


def test_qlora_quantises_the_adapted_weights_whose_shards_are_whole_nf4_blocks():
    """GPT-2's Conv1D layers become Linear (the same function); of the adapted
    weights, those whose shards split into whole blocks of 64 x 256 weights over
    the ranks turn 4-bit, the others stay, and the model still computes nearly
    what it did (NF4 rounds each weight to one of 16 levels per block)."""
    pytest.importorskip("torchao")
    from finetune.parameters import held_bytes
    from finetune.peft import lora, qlora

    torch.manual_seed(0)
    # c_attn 128 x 384 (49,152 weights: 3 blocks of 16,384, not splittable over 2 ranks), c_proj 128 x 128
    # (1 block), c_fc / mlp.c_proj 128 x 512 (4 blocks: 2 per rank).
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=128, n_layer=1, n_head=2, n_positions=32)).eval()
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        before = model(tokens).logits
    assert qlora.linears_for_conv1d(model) == 4
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, before, rtol=0, atol=1e-5)

    model = lora.add_adapters(model, lora.lora_config(4, 8.0, 0.0, "all-linear"))
    quantized, kept = qlora.quantize_adapted_bases(model, world_size=2, device=torch.device("cpu"))
    assert quantized == 2
    assert sorted(name.removeprefix("base_model.model.transformer.h.0.") for name in kept) == ["attn.c_attn", "attn.c_proj"]
    nf4 = qlora.nf4_tensor_class()
    weights = {name: p for name, p in model.named_parameters() if name.endswith("base_layer.weight")}
    four_bit = {name for name, p in weights.items() if isinstance(p, nf4)}
    assert four_bit == {n for n in weights if ".mlp." in n}
    for name in four_bit:
        assert not weights[name].requires_grad
        assert held_bytes(weights[name]) < 0.55 * weights[name].numel()  # about half a byte per weight
    with torch.no_grad():
        after = model(tokens).logits
    assert not torch.equal(after, before)
    assert (after - before).abs().max() < 0.1 * before.abs().max()


@pytest.mark.parametrize("args, code", [(["configs"], 0), (["configs", "--path", "no-such-config"], 2)])
def test_the_command_exits_with_its_code_after_the_atexit_hooks_and_its_output(args, code):
    """`entry` skips the interpreter's teardown (os._exit), not what a normal exit does."""
    script = f"""
import atexit, sys
from finetune import cli
atexit.register(lambda: sys.stdout.write("hook ran\\n"))  # unflushed: the exit must flush it
sys.argv = ["finetune", *{args!r}]
cli.entry()
print("not reached")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert proc.stdout.endswith("hook ran\n") and "not reached" not in proc.stdout
    assert ("error:" in proc.stderr) == (code != 0)


def test_help_and_configs_import_no_transformers():
    """`finetune --help` and `finetune configs` stay instant: nothing imports transformers for them."""
    script = """
import contextlib, io, sys
from finetune.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["configs"]) == 0
    try:
        main(["--help"])
    except SystemExit:
        pass
print("transformers" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "False"


def test_each_method_runs_the_model_without_what_it_added():
    """`adapters_off`: the base's forward under LoRA (what a preference method's
    reference model will be), the adapters back afterwards; a full fine-tune
    added nothing to switch off."""
    pytest.importorskip("peft")
    from finetune.peft import method_for

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16)).eval()
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        base_logits = base(tokens).logits.clone()
    method = method_for(TrainConfig(peft="lora", lora_r=4))
    model = method.wrap(base, source="in-memory", accelerator=None, record_base=False).eval()  # no dropout
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p)  # peft starts B at zero: the adapters would change nothing yet
    with torch.no_grad():
        adapted = model(tokens).logits.clone()
        with method.adapters_off(model):
            off = model(tokens).logits.clone()
        again = model(tokens).logits
    assert not torch.allclose(adapted, base_logits, atol=1e-4)
    torch.testing.assert_close(off, base_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(again, adapted, rtol=0, atol=0)

    full = method_for(TrainConfig())
    assert full.wrap(base, source="in-memory", accelerator=None, record_base=False) is base
    with full.adapters_off(base):
        pass


def test_one_stop_request_delivered_twice_is_not_a_second_request(monkeypatch):
    """Ctrl-C reaches a rank from the terminal and again from the launcher: the
    repeat, moments later, must not abandon the checkpoint; a later signal stops at once."""
    import signal
    import time

    from finetune import stopping

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    with stopping.StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # from the terminal
        clock[0] += 0.2
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's copy
        assert stop.received == signal.SIGINT and stop.flag == 1.0
        clock[0] += stopping.REPEAT_GRACE_S
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the user's second Ctrl-C


def test_a_failed_write_gets_the_fix_of_its_cause():
    """"Free space" only for a full disk: an existing file or dir in the way, or
    a permission, gets its own fix (the OS's own words, as the write reports them)."""
    import errno

    from finetune.errors import write_failure_fix

    where = "RUN/checkpoints"
    assert write_failure_fix(os.strerror(errno.ENOSPC), where) == "free space on that device"
    assert write_failure_fix("torch.save failed", where, out_of_space=True) == "free space on that device"
    for code in (errno.EACCES, errno.EROFS):
        assert write_failure_fix(f"[Errno {code}] {os.strerror(code)}: '{where}/x'", where) == \
            f"fix the permissions of {where}"
    for code in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
        fix = write_failure_fix(f"[Errno {code}] {os.strerror(code)}: '{where}/.tmp-step_000002'", where)
        assert fix == f"move aside what is already in the way under {where}", code
        assert "free space" not in fix
    assert "free space" not in write_failure_fix("CheckpointException: something else", where)


MESH_ENV = {"dp_replicate_size": "1", "dp_shard_size": "1", "tp_size": "1", "cp_size": "1", "sp_size": "1"}


@pytest.mark.parametrize("sizes, world, dims, problem", [
    ({"dp_replicate_size": "2", "dp_shard_size": "2"}, 2, {"dp_replicate", "dp_shard"}, "= 4 ranks, but 2 were launched"),
    ({"dp_replicate_size": "2"}, 2, {"dp_replicate", "dp_shard"}, "leaves FSDP nothing to shard over"),
    ({"tp_size": "2"}, 2, {"dp_replicate", "dp_shard", "tp"}, "tensor parallelism runs under FSDP here"),
    ({"tp_size": "2"}, 2, {"dp_replicate", "dp_shard"}, "asks for tp 2, which this launch's backend (DDP)"),
    ({"dp_shard_size": "2", "cp_size": "2"}, 4, {"dp_replicate", "dp_shard"}, "asks for context parallelism"),
    ({"sp_size": "2"}, 2, {"dp_replicate", "dp_shard"}, "asks for sequence parallelism"),
    ({"dp_replicate_size": "2", "dp_shard_size": "2"}, 4, set(), "backend (DDP) does not lay a model out on"),
    ({"dp_shard_size": "two"}, 2, {"dp_shard"}, "'two' is not a positive number of ranks"),
])
def test_a_mesh_the_run_cannot_have_is_refused_in_one_line(monkeypatch, sizes, world, dims, problem):
    from finetune.backends.mesh import check_requested_mesh

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for name, value in {**MESH_ENV, **sizes}.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{name.upper()}", value)
    with pytest.raises(UsageError) as refused:
        check_requested_mesh(world, frozenset(dims), "DDP", on_gpu=False)
    message = str(refused.value)
    assert problem in message and "\n" not in message
    # ...and the mesh it can have passes.
    for mesh in ({"dp_replicate_size": "2", "dp_shard_size": "2"}, {"dp_shard_size": "2", "tp_size": "2"}):
        for name, value in {**MESH_ENV, **mesh}.items():
            monkeypatch.setenv(f"PARALLELISM_CONFIG_{name.upper()}", value)
        check_requested_mesh(4, frozenset({"dp_replicate", "dp_shard", "tp"}), "FSDP2", on_gpu=False)


def test_a_config_s_mesh_size_that_is_not_a_number_is_one_line(tmp_path):
    from conftest import run_in_process

    config = tmp_path / "bad.yaml"
    config.write_text("distributed_type: FSDP\nparallelism_config:\n  parallelism_config_dp_replicate_size: two\n")
    proc = run_in_process("estimate-memory", "--model", "tiny-gpt2", "--accelerate_config", config)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "parallelism_config_dp_replicate_size: 'two' is not a positive number of ranks" in proc.stderr
