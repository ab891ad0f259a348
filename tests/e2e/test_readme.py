"""The README's commands, run as written (see `readme_workdir` in conftest.py
for which are left out and why), and what they promise."""

from __future__ import annotations

import json

import pytest

from conftest import README_SKIPPED, REPO, readme_commands

pytestmark = pytest.mark.slow


def test_readme_has_the_commands_this_test_runs():
    commands = readme_commands()
    run = [c for c in commands if not any(marker in c for marker in README_SKIPPED)]
    assert commands[:2] == ["bash scripts/quickstart.sh", "bash scripts/test.sh"]  # the two commands first
    assert any("-m finetune train" in c for c in run)
    assert {c.split()[1] for c in run if c.startswith("finetune ")} == {"resume", "export", "generate", "evaluate",
                                                                        "estimate-memory", "configs"}


def test_readme_training_resuming_and_export(readme_workdir):
    run_dir = readme_workdir / "outputs" / "my-run"
    summary = json.loads((run_dir / "summary.json").read_text())
    # Trained to 30, then resumed to 40 by `finetune resume` typed without a launcher: relaunched under FSDP.
    assert summary["distributed_type"] == "FSDP" and summary["world_size"] == 2 and summary["steps"] == 40
    assert (run_dir / "checkpoints" / "step_000020").is_dir()
    assert (readme_workdir / "my-model" / "model.safetensors").is_file()
    assert json.loads((readme_workdir / "m" / "config.json").read_text())["dtype"] == "bfloat16"
    log = (readme_workdir / "commands.log").read_text()
    assert '"perplexity"' in log and "Return the" in log


def test_readme_memory_planner_example(readme_workdir):
    """What the README says of the blog's example: 48 GB of state per GPU under
    DDP (it does not fit in 48 GB), about 12 GB under 4-way FSDP (it fits)."""
    log = (readme_workdir / "commands.log").read_text()
    section = log[log.index("$ finetune estimate-memory --model gpt2-3b"):]
    end = section.find("\n$ ", 1)  # the next command's output
    section = section if end < 0 else section[:end]
    rows = {cells[0]: cells for line in section.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}

    def state_gb(strategy: str) -> float:
        return sum(int(rows[strategy][i].replace(",", "")) for i in (1, 2, 3)) / 1e9

    assert 48.0 <= state_gb("DDP") < 49.0 and rows["DDP"][-1] == "no"
    assert 12.0 <= state_gb("FSDP full shard") < 12.5 and rows["FSDP full shard"][-1] == "yes"


def test_readme_multinode_plan_is_what_the_planner_prints(readme_workdir):
    """The 8 x 8 plan of a 70B Llama: every table row and recommendation the
    README prints after its two estimate-memory commands is in their output."""
    readme = (REPO / "README.md").read_text()
    plan = readme[readme.index("**A plan for 8 nodes x 8 GPUs"):readme.index("A test runs these commands as printed")]
    log = (readme_workdir / "commands.log").read_text()
    outputs = log[log.index("$ finetune estimate-memory --model llama-3-70b"):]
    printed = [line for line in plan.splitlines() if line.startswith(("| FSDP", "| HSDP", "Recommended:"))]
    assert len(printed) >= 12
    for line in printed:
        assert line in outputs, line
    # What the prose draws from them.
    assert "Recommended: FSDP 8 x TP 8:" in plan
    assert "Recommended: HSDP 8 x 8 with activation checkpointing" in plan
