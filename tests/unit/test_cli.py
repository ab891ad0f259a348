"""Unit tests of the command line: help, exit codes, what each command imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from finetune.config import config_fields


def _cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "finetune", *args], capture_output=True, text=True, cwd=cwd,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})


def test_train_help_lists_every_option_with_its_default():
    out = _cli("train", "--help").stdout
    for f in config_fields():
        assert f"--{f.name}" in out, f.name
    assert "--dry_run" in out  # the one option that is not a config field: it is never saved with a run
    assert out.count("(default:") == len(config_fields()) + 1


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
    assert headings[:8] == ["options", "model", "data", "vision-language models (--task image-text-to-text)",
                            "training", "LoRA (--peft lora, qlora)",
                            "mixture of experts (--method sft)",
                            "preference data (--method dpo, simpo, orpo, kto, reward)"]
    assert "online RL (--method grpo, rloo)" in headings and "DPO (--method dpo)" in headings
    assert headings[-3:-1] == ["checkpoints and outputs", "evaluation and logging"]
    assert headings[-1].startswith("FSDP and launch (sharding, processes and precision come from `accelerate launch")
    assert "--config FILE.yaml" in train and "--config " not in _cli("resume", "--help").stdout


def test_console_exit_code_2_and_one_line_for_bad_input(tmp_path):
    """A real process (the other bad inputs are in test_errors.py, in-process)."""
    proc = _cli("train", "--max_step", "3", "--output_dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error: unknown option --max_step; did you mean --max_steps?; see `finetune train --help`"
    assert not (tmp_path / "run").exists()


def test_a_rank_forked_after_import_still_leaves_the_word_to_rank_zero(tmp_path, monkeypatch):
    """A rank that is not 0 meets bad input and waits for its launcher (here:
    this process) to end it, so that rank 0 can print first. The launcher is
    the parent when the command starts, not when finetune was imported: a
    process forked from one that had imported it must wait too."""
    import os
    import time

    from finetune import cli

    monkeypatch.setattr(cli, "RANK_ZERO_GRACE_S", 1.5)
    monkeypatch.setenv("RANK", "1")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the rank: its parent is this test's process, not the one that imported finetune
        os.close(read)
        start = time.monotonic()
        code = cli.run_command(["train", "--max_step", "3", "--output_dir", str(tmp_path / "run")])
        os.write(write, f"{code} {time.monotonic() - start}".encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        code, waited = pipe.read().split()
    os.waitpid(child, 0)
    assert int(code) == 2 and float(waited) >= 1.4


def test_top_level_help_lists_the_commands():
    out = _cli("--help").stdout
    for command in ("train", "resume", "export", "generate", "evaluate", "estimate-memory"):
        assert command in out


@pytest.mark.slow  # a fresh interpreter of its own (what it imports): not the quick tier's
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
