"""The commands of the README and the docs, run or checked as written (see
`how_docs_check` in conftest.py), what they promise, and the site they build."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, check_ok, doc_pages, docs_commands, free_port, new_shell_env

pytestmark = pytest.mark.slow


def test_the_docs_hold_the_commands_this_test_runs():
    commands = docs_commands()
    assert commands[:2] == ["bash scripts/quickstart.sh", "bash scripts/test.sh"]  # the README's two commands first
    assert any("-m finetune train" in c for c in commands)
    assert {c.split()[1] for c in commands if c.startswith("finetune ")} == {"resume", "export", "generate", "evaluate",
                                                                            "estimate-memory", "configs"}
    assert len(REPO.joinpath("README.md").read_text().splitlines()) <= 250  # the front door stays short


def test_a_new_shell_finds_the_commands_only_after_the_readme_says_how(tmp_path, env):
    """The README's commands after the quickstart, typed into a new shell: only
    the README's own `source` line (which it names right after the quickstart)
    puts `accelerate` and `finetune` on its PATH."""
    readme = (REPO / "README.md").read_text()
    source = next(c for c in docs_commands() if c.startswith("source "))
    assert readme.index(source) < readme.index("```bash\naccelerate launch")  # before the first command that needs it
    (tmp_path / ".venv").symlink_to(sys.prefix)
    find = "command -v accelerate && command -v finetune"
    shell = new_shell_env(env)
    bare = subprocess.run(["bash", "-c", find], env=shell, cwd=tmp_path, capture_output=True, text=True)
    entered = subprocess.run(["bash", "-c", f"{source}\n{find}"], env=shell, cwd=tmp_path, capture_output=True,
                             text=True)
    assert bare.returncode != 0 or str(Path(sys.prefix)) not in bare.stdout, bare.stdout
    assert entered.returncode == 0 and entered.stdout.count(str(Path(sys.prefix) / "bin")) == 2, entered


def test_every_page_is_in_the_site_and_every_example_writes_under_outputs():
    pages = doc_pages()
    assert {p.name for p in pages[1:]} == {p.name for p in (REPO / "docs").glob("*.md")}  # no page left out of the nav
    for command in docs_commands():
        words = command.split()
        for option in ("--output_dir", "--output"):
            if option in words:
                target = words[words.index(option) + 1]
                assert target.startswith(("outputs/", "/shared/")), command  # git ignores outputs/


def test_docs_training_resuming_and_export(docs_workdir):
    run_dir = docs_workdir / "outputs" / "my-run"
    summary = json.loads((run_dir / "summary.json").read_text())
    # Trained to 30, then resumed to 40 by `finetune resume` typed without a launcher: relaunched under FSDP.
    assert summary["distributed_type"] == "FSDP" and summary["world_size"] == 2 and summary["steps"] == 40
    assert (run_dir / "checkpoints" / "step_000020").is_dir()
    assert (docs_workdir / "outputs" / "my-model" / "model.safetensors").is_file()
    assert json.loads((docs_workdir / "outputs" / "m" / "config.json").read_text())["dtype"] == "bfloat16"
    log = (docs_workdir / "commands.log").read_text()
    assert '"perplexity"' in log and "Return the" in log


def test_docs_memory_planner_example(docs_workdir):
    """What the README says of the blog's example: 48 GB of state per GPU under
    DDP (it does not fit in 48 GB), about 12 GB under 4-way FSDP (it fits)."""
    log = (docs_workdir / "commands.log").read_text()
    section = log[log.index("$ finetune estimate-memory --model outputs/gpt2-3b"):]
    end = section.find("\n$ ", 1)  # the next command's output
    section = section if end < 0 else section[:end]
    rows = {cells[0]: cells for line in section.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}

    def state_gb(strategy: str) -> float:
        return sum(int(rows[strategy][i].replace(",", "")) for i in (1, 2, 3)) / 1e9

    assert 48.0 <= state_gb("DDP") < 49.0 and rows["DDP"][-1] == "no"
    assert 12.0 <= state_gb("FSDP full shard") < 12.5 and rows["FSDP full shard"][-1] == "yes"


def test_docs_multinode_plan_is_what_the_planner_prints(docs_workdir):
    """The 8 x 8 plan of a 70B Llama: every table row and recommendation the
    planner page prints after its two estimate-memory commands is in their output."""
    page = (REPO / "docs" / "memory-planner.md").read_text()
    plan = page[page.index("## A plan for 8 nodes x 8 GPUs"):page.index("A test runs these commands as printed")]
    log = (docs_workdir / "commands.log").read_text()
    outputs = log[log.index("$ finetune estimate-memory --model outputs/llama-3-70b"):]
    printed = [line for line in plan.splitlines() if line.startswith(("| FSDP", "| HSDP", "Recommended:"))]
    assert len(printed) >= 12
    for line in printed:
        assert line in outputs, line
    # What the prose draws from them.
    assert "Recommended: FSDP 8 x TP 8:" in plan
    assert "Recommended: HSDP 8 x 8 with activation checkpointing" in plan


# Rank 1 reads a clock one second ahead of rank 0's: what two ranks may do on a loaded machine.
CLOCK_A_SECOND_AHEAD = '''
import os, time
if os.environ.get("RANK") == "1":
    _strftime = time.strftime

    def strftime(format, t=None):
        return _strftime(format, time.localtime(time.time() + 1) if t is None else t)
    time.strftime = strftime
'''


def test_the_own_files_command_as_written_makes_one_run_dir_when_the_ranks_clocks_differ(tmp_path, env):
    """The README's "on your own files" command, its placeholders stood in for
    by a small model dir and notes.jsonl, launched as written (no
    --output_dir: the default run dir, named from the clock): rank 1's clock
    is a second ahead, and the run still writes one run dir."""
    from sft_models import save_chat_model

    command = next(c for c in docs_commands() if "--text_column body" in c and "--dry_run" not in c)
    save_chat_model(tmp_path / "path" / "to" / "hf_model_dir")
    words = "the model reads a file and returns its lines sorted by length then writes them back".split()
    notes = [{"body": f"note {i}: " + " ".join(words[(i + j) % len(words)] for j in range(60))} for i in range(120)]
    (tmp_path / "path" / "to" / "notes.jsonl").write_text("".join(json.dumps(n) + "\n" for n in notes))
    (tmp_path / "accelerate_configs").symlink_to(REPO / "accelerate_configs")
    (tmp_path / "clock").mkdir()
    (tmp_path / "clock" / "sitecustomize.py").write_text(CLOCK_A_SECOND_AHEAD)
    words = shlex.split(command)
    assert words[:2] == ["accelerate", "launch"] and "--output_dir" not in words
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()),
                           *words[2:]], env={**env, "PYTHONPATH": str(tmp_path / "clock")}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    check_ok(proc)
    run_dirs = list((tmp_path / "outputs").iterdir())
    assert len(run_dirs) == 1 and (run_dirs[0] / "final" / "config.json").is_file(), run_dirs
    assert f"run dir: outputs/{run_dirs[0].name}" in proc.stdout


def test_the_site_builds_strict_and_a_broken_link_fails_it(tmp_path):
    """`mkdocs build --strict`: every page, link and anchor resolves. The same
    build of a copy with one broken anchor fails, so the check is live."""
    def build(root: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                              cwd=root, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})

    proc = build(REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "lora" / "index.html").is_file()
    # What the build does not check: each list item and table row of a page is one in its HTML.
    for page in sorted((REPO / "docs").glob("*.md")):
        html = (tmp_path / "site" / ("" if page.stem == "index" else page.stem) / "index.html").read_text()
        assert rendered_structure(html) == markdown_structure(page.read_text()), page.name
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    # A list glued to the paragraph before it builds, strict, and renders as one paragraph: the check sees it.
    training = copy / "docs" / "training.md"
    training.write_text(training.read_text().replace("sharded.\n\n- `--model`", "sharded.\n- `--model`", 1))
    assert build(copy).returncode == 0
    html = (tmp_path / "site" / "training" / "index.html").read_text()
    assert rendered_structure(html) != markdown_structure(training.read_text())
    page = copy / "docs" / "lora.md"
    page.write_text(page.read_text() + "\nSee [the planner](memory-planner.md#no-such-section).\n")
    broken = build(copy)
    assert broken.returncode != 0 and "no-such-section" in broken.stderr, broken.stderr[-2000:]


LIST_ITEM = re.compile(r"^\s*([-*]|\d+\.) \S")
TABLE_ROW = re.compile(r"^\s*\|")
TABLE_RULE = re.compile(r"^\s*\|[\s:|-]+\|?\s*$")


def markdown_structure(text: str) -> tuple[int, int]:
    """The list items and table rows (header rows included) a page's Markdown
    writes, outside code blocks."""
    items = rows = 0
    fenced = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            items += bool(LIST_ITEM.match(line))
            rows += bool(TABLE_ROW.match(line)) and not TABLE_RULE.match(line)
    return items, rows


def rendered_structure(html: str) -> tuple[int, int]:
    """The list items and table rows of a built page's article (not the site's navigation)."""
    article = html[html.index("<article"):html.index("</article>")]
    return len(re.findall(r"<li[ >]", article)), len(re.findall(r"<tr[ >]", article))
