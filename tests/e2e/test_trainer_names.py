"""Users of the HF Trainer and run_clm.py: their option names mean the same
here, launch options are pointed to `accelerate launch`, and a local dataset
dir with several configurations loads by name."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import check_ok, read_jsonl, run_cli, run_in_process
from sft_models import save_chat_model


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "notes.txt"
    words = "the model reads a file and returns its lines sorted by length then writes them back".split()
    path.write_text("".join(" ".join(words[i % 7:] + words[:i % 7]) + "\n" for i in range(120)))
    return path


@pytest.mark.slow
def test_a_run_clm_command_line_runs_as_written(tmp_path, env, text_file):
    model = save_chat_model(tmp_path / "pretrained")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run_config.yaml").write_text("max_steps: 1\n")  # an old run: --overwrite_output_dir lets it go
    proc = run_cli(["train", "--model_name_or_path", str(model), "--dataset_name", str(text_file),
                    "--num_train_epochs", "1", "--per_device_train_batch_size", "2", "--save_steps", "5",
                    "--save_total_limit", "2", "--logging_steps", "1", "--warmup_ratio", "0.1",
                    "--lr_scheduler_type", "linear", "--overwrite_output_dir", "--block_size", "32",
                    "--sample_prompt", "", "--output_dir", str(run_dir)], env, nproc=None, warm=True)
    check_ok(proc)
    text = (run_dir / "run_config.yaml").read_text()
    assert text.startswith("# fine-tuning defaults") and f"--model {model} is a pretrained model" in text.splitlines()[0]
    cfg = yaml.safe_load(text)
    assert (cfg["model"], cfg["dataset"], cfg["num_epochs"], cfg["per_device_batch_size"], cfg["checkpoint_every"],
            cfg["keep_last"], cfg["log_every"], cfg["warmup_ratio"], cfg["lr_scheduler_type"], cfg["overwrite"]) == \
        (str(model), str(text_file), 1, 2, 5, 2, 1, 0.1, "linear", True)
    assert (cfg["learning_rate"], cfg["weight_decay"], cfg["adam_beta2"]) == (5e-5, 0.0, 0.999)  # fine-tuning defaults

    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    steps = json.loads((run_dir / "summary.json").read_text())["steps"]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and steps > 10
    warmup = -(-steps // 10)
    lrs = [r["lr"] for r in rows]
    assert lrs[0] == 0.0 and lrs[warmup] == pytest.approx(5e-5)  # linear warmup over 10%, then linear decay
    assert lrs[-1] == pytest.approx(5e-5 / (steps - warmup))
    assert len(list((run_dir / "checkpoints").glob("step_*"))) == 2


@pytest.mark.parametrize("option, where", [("--num_processes", "accelerate launch"), ("--bf16", "--mixed_precision bf16"),
                                           ("--gradient_checkpointing", "configs --path fsdp_activation_checkpointing")])
def test_launch_options_after_the_command_say_where_they_go(option, where, tmp_path):
    proc = run_in_process("train", "--max_steps", "3", option, "2", "--output_dir", tmp_path / "out")
    assert proc.returncode == 2 and where in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    # The fix is the user's own command, launched: it runs as printed.
    launch = proc.stderr[proc.stderr.index("run `") + 5:proc.stderr.rindex("`")]
    assert launch.startswith("accelerate launch --config_file $(finetune configs --path fsdp")
    assert launch.endswith(f" -m finetune train --max_steps 3 --output_dir {tmp_path / 'out'}"), launch


def test_yaml_configs_take_the_same_names(tmp_path):
    from finetune.config import load_config
    from finetune.errors import UsageError

    (tmp_path / "run.yaml").write_text("model_name_or_path: some/model\nnum_train_epochs: 3\nsave_total_limit: 1\n")
    cfg = load_config(tmp_path / "run.yaml", {})
    assert (cfg.model, cfg.num_epochs, cfg.keep_last) == ("some/model", 3, 1)
    (tmp_path / "twice.yaml").write_text("num_epochs: 2\nnum_train_epochs: 3\n")
    with pytest.raises(UsageError, match="sets num_epochs twice"):
        load_config(tmp_path / "twice.yaml", {})


def test_a_local_dataset_with_two_configs_loads_by_name(tmp_path):
    from finetune.data.text import load_raw_text
    from finetune.errors import UsageError

    data = tmp_path / "two-configs"
    for name, text in (("short", "a short note {}"), ("long", "a much longer document about the model, number {}")):
        (data / name).mkdir(parents=True)
        (data / name / "part.jsonl").write_text("".join(json.dumps({"text": text.format(i)}) + "\n" for i in range(8)))
    (data / "README.md").write_text("---\nconfigs:\n- config_name: short\n  data_files: short/*.jsonl\n"
                                    "- config_name: long\n  data_files: long/*.jsonl\n---\n")
    raw = load_raw_text(str(data), "text", 0.25, 0, config="long")
    assert sorted(list(raw["train"]["text"]) + list(raw["validation"]["text"])) == \
        sorted(f"a much longer document about the model, number {i}" for i in range(8))
    with pytest.raises(UsageError, match=r"BuilderConfig 'medium' not found.*'short', 'long'.*--dataset_config"):
        load_raw_text(str(data), "text", 0.25, 0, config="medium")
