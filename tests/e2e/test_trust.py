"""Checkpoints and runs you can trust: every checkpoint file is in its
manifest, a dead run's lock is taken over, symlinks are never followed for
deletion, a rewound resume sets the abandoned timeline aside, and dropout is
seeded. (The bad-input cases of the same kind, with their one-line messages,
are in test_errors.py.)"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    CONFIGS,
    REPO,
    check_ok,
    common_args,
    free_port,
    run_cli,
    run_in_process,
    train_rows,
)
from sft_models import conversations, write_jsonl
from e2e.test_errors import one_error_line, snapshot

from finetune.checkpoint import verify_checkpoint
from finetune.run_dir import checkpoint_step, complete_checkpoints
from finetune.errors import UsageError
from finetune.lock import LOCK_FILE


def copy_run(checkpointed_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(checkpointed_run, run_dir)
    return run_dir


def test_every_checkpoint_file_is_in_the_manifest(checkpointed_run):
    checkpoint = checkpointed_run / "checkpoints" / "step_000006"
    listed = json.loads((checkpoint / "manifest.json").read_text())["files"]
    on_disk = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(listed) == on_disk
    assert verify_checkpoint(checkpoint).step == 6


def test_a_stale_lock_is_taken_over(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    gone = 2**22 + 12345  # above the kernel's default pid range: no such process
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": gone, "host": socket.gethostname(), "since": "then"}))
    proc = run_in_process("train", *common_args(small_corpus), "--max_steps", "1", "--output_dir", run_dir)
    check_ok(proc)
    assert f"was left by pid {gone}, which is no longer running" in proc.stdout
    assert not (run_dir / LOCK_FILE).exists()  # released at the end


def test_symlinked_checkpoints_are_never_listed_or_pruned(tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "step_000002").mkdir(parents=True)
    (checkpoints / "step_000001").symlink_to(outside)
    assert [p.name for p in complete_checkpoints(tmp_path / "run")] == ["step_000002"]


@pytest.mark.slow
def test_a_rewound_resume_sets_the_abandoned_timeline_aside(checkpointed_run, tmp_path, env):
    """The docs' NaN recipe (resuming.md): resume from an older checkpoint. Its later
    checkpoints belong to the abandoned timeline: moved aside, and the new
    run's own checkpoints are really written."""
    run_dir = copy_run(checkpointed_run, tmp_path)
    old_twelve = (run_dir / "checkpoints" / "step_000012" / "manifest.json").read_text()
    proc = run_cli(["resume", str(run_dir), "--resume_from_checkpoint", str(run_dir / "checkpoints" / "step_000006"),
                    "--checkpoint_every", "3", "--max_steps", "9"], env, mixed_precision="no", warm=True)
    check_ok(proc)
    aside = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("abandoned-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step_000012"]
    assert (aside[0] / "step_000012" / "manifest.json").read_text() == old_twelve
    assert "moved 1 checkpoint(s) of the abandoned timeline (step_000012...step_000012) aside" in proc.stdout
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_000006", "step_000009"]
    assert verify_checkpoint(run_dir / "checkpoints" / "step_000009").step == 9
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, 10))


def test_dropout_is_seeded(tmp_path, small_corpus):
    """A model dir with dropout: the same seed gives the same losses."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from finetune.data.tokenizer import train_bpe_tokenizer

    texts = small_corpus.read_text().splitlines()
    tokenizer = train_bpe_tokenizer(texts, vocab_size=512)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=128, vocab_size=512,
                               resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
                    ).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    losses = []
    for name in ("a", "b"):
        check_ok(run_in_process("train", *common_args(small_corpus), "--model", tmp_path / "model", "--max_steps", "3",
                                "--output_dir", tmp_path / name))
        losses.append([r["loss"] for r in train_rows(tmp_path / name)])
    assert losses[0] == losses[1]


CHAOS_ROUNDS = 3


@pytest.mark.slow
def test_chaos_sigkill_anywhere_then_resume_latest(tmp_path, env, small_corpus):
    """Rounds of: a 2-process run (resuming `latest` after the first), SIGKILL
    of a random process (either rank or the launcher) at a random moment after
    its first new checkpoint (mid-step, mid-save or mid-rename), every process
    gone within a minute (a killed launcher takes its ranks with it), and the
    newest checkpoint verifying against its manifest. Then a last resume runs
    to the end: every step logged exactly once."""
    from e2e.test_resume import _launch_background, _rank_pids

    rng = random.Random(20261123)
    victims = [("launcher", "rank 0", "rank 1")[i % 3] for i in range(CHAOS_ROUNDS)]  # each kind, in random order
    rng.shuffle(victims)
    run_dir = tmp_path / "run"
    newest = 0
    for round_index, victim in enumerate(victims):
        args = ["train", *common_args(small_corpus), "--max_steps", "400", "--checkpoint_every", "2",
                "--output_dir", str(run_dir)] + (["--resume_from_checkpoint", "latest"] if round_index else [])
        proc = _launch_background(args, env)
        try:
            deadline = time.time() + 120
            while not any(checkpoint_step(c) > newest for c in complete_checkpoints(run_dir)):
                assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 1.5))
            ranks = _rank_pids(proc.pid)
            os.kill({"launcher": proc.pid, "rank 0": ranks[0], "rank 1": ranks[1]}[victim], signal.SIGKILL)
            deadline = time.time() + 60
            while any(_running(pid) for pid in [proc.pid, *ranks]):
                assert time.time() < deadline, f"round {round_index}: processes outlived the SIGKILL of the {victim}"
                proc.poll()
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        latest = complete_checkpoints(run_dir)[-1]
        assert checkpoint_step(latest) > newest, f"round {round_index} ({victim}) saved no new checkpoint"
        newest = checkpoint_step(latest)
        assert verify_checkpoint(latest).step == newest
    check_ok(run_cli(["resume", str(run_dir), "--max_steps", str(newest + 2)], env, mixed_precision="no", warm=True))
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, newest + 3)), "each step logged once"


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_a_rank_that_stops_answering_ends_the_run_with_one_line_naming_it(tmp_path, env, small_corpus):
    """SIGSTOP one rank mid-run: the other times out in its next collective
    (--ddp_timeout) and the run ends, naming the silent rank and ending it
    (it runs on this machine), instead of hanging."""
    from e2e.test_resume import _launch_background, _rank_pids

    run_dir = tmp_path / "run"
    proc = _launch_background(["train", *common_args(small_corpus), "--max_steps", "400", "--checkpoint_every", "2",
                               "--ddp_timeout", "5", "--output_dir", str(run_dir)], env)
    try:
        deadline = time.time() + 120
        while not complete_checkpoints(run_dir):
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.01)
        ranks = _rank_pids(proc.pid)
        os.kill(ranks[1], signal.SIGSTOP)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-3000:]
    assert "[rank 0] rank(s) 1 stopped answering: no collective completed within --ddp_timeout 5 s" in errors[0]
    assert f"continue with `finetune resume {run_dir}`" in errors[0]
    assert f"ended rank 1's process (pid {ranks[1]}) on this machine" in errors[0]
    assert proc.returncode != 0 and not _running(ranks[1])


@pytest.mark.slow
def test_a_full_disk_keeps_the_previous_checkpoint_and_ends_with_one_line(tmp_path, env, small_corpus):
    """The run dir on a 6 MB filesystem (a tmpfs in a user and mount namespace
    of its own): the first checkpoint fits, the second does not."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no user and mount namespaces here (unshare -rm) to make a small filesystem in")
    disk, after = tmp_path / "disk", tmp_path / "after"
    disk.mkdir()
    run_dir = disk / "run"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "fsdp.yaml"),
              "--num_processes", "2", "--main_process_port", str(free_port()), "--mixed_precision", "no",
              "-m", "finetune", "train", *common_args(small_corpus), "--max_steps", "400", "--checkpoint_every", "2",
              "--output_dir", str(run_dir)]
    script = (f"mount -t tmpfs -o size=6m tmpfs {disk} || exit 77; {shlex.join(launch)}; code=$?; "
              f"cp -r {disk} {after}; exit $code")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode == 77:
        pytest.skip("cannot mount a tmpfs in a user namespace here")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"could not write checkpoint {run_dir}/checkpoints/step_000004 (no space left on the device, " in errors[0]
    assert f"{run_dir}/checkpoints/step_000002 is intact: free space" in errors[0]
    assert not re.search(r"\[rank\d\]: Traceback", proc.stderr), proc.stderr[-3000:]
    checkpoints = after / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002"]  # no temporary dir left
    assert verify_checkpoint(checkpoints / "step_000002").step == 2


@pytest.mark.parametrize("command", ["train", "export", "export gguf"])
@pytest.mark.parametrize("where", ["/proc/finetune-test/out", "/sys/finetune-test/out"])
def test_an_output_on_a_file_system_that_takes_no_new_files_is_one_line(command, where, tmp_path):
    """/proc refuses new entries (ENOENT), /sys is read-only: the permission
    bits allow both to root, so only trying tells."""
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    args = {"train": ["train", "--model", "tiny-gpt2", "--dataset", "builtin", "--output_dir", where],
            "export": ["export", source, "--output", where],
            "export gguf": ["export", source, "--format", "gguf", "--output", where + ".gguf"]}[command]
    proc = run_in_process(*args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = one_error_line(proc.stderr)
    assert "/proc" in line or "/sys" in line, line
    assert "choose another --output" in line, line


@pytest.mark.slow
def test_a_read_only_output_dir_is_refused_before_training(tmp_path, env):
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no user and mount namespaces here (unshare -rm) to make a read-only dir in")
    ro = tmp_path / "ro"
    ro.mkdir()
    command = shlex.join([sys.executable, "-m", "finetune", "train", "--max_steps", "1", "--output_dir", str(ro / "run")])
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind {ro} {ro} && mount -o remount,ro,bind {ro} "
                           f"|| exit 77; exec {command}"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    if proc.returncode == 77:
        pytest.skip("cannot make a read-only bind mount in a user namespace here")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: --output_dir {ro / 'run'} cannot be written ({ro} is read-only); " \
                                  "choose another --output_dir"


@pytest.mark.slow
def test_export_to_a_full_disk_leaves_nothing_and_says_so(tmp_path, env, checkpointed_run):
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no user and mount namespaces here (unshare -rm) to make a small filesystem in")
    disk = tmp_path / "disk"
    disk.mkdir()
    command = shlex.join([sys.executable, "-m", "finetune", "export", str(checkpointed_run), "--output",
                          str(disk / "out")])
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=300k tmpfs {disk} || exit 77; "
                           f"{command}; code=$?; ls -A {disk}; exit $code"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    if proc.returncode == 77:
        pytest.skip("cannot mount a tmpfs in a user namespace here")
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert line.startswith(f"error: could not write {disk / 'out'} (") and "No space left on device" in line
    assert proc.stdout.strip() == ""  # the filesystem holds nothing: no output, no temporary dir


def _without_manifest(checkpointed_run: Path, tmp_path: Path) -> Path:
    run_dir = copy_run(checkpointed_run, tmp_path)
    checkpoint = run_dir / "checkpoints" / "step_000006"
    (checkpoint / "manifest.json").unlink()  # so that each check below, not the checksums, finds the damage
    return checkpoint


@pytest.mark.parametrize("damage, named", [
    (lambda c: shutil.rmtree(c / "optimizer_0"), "optimizer.bin is missing"),
    (lambda c: (c / "scheduler.bin").unlink(), "scheduler.bin is missing"),
    (lambda c: (c / "random_states_0.pkl").write_bytes(b"garbage"), "random_states_0.pkl is not readable"),
    (lambda c: (c / "training_progress.json").write_text("{not json"), "training_progress.json is missing or not"),
    (lambda c: (c / "training_progress.json").write_text('{"step": "six"}'), "training_progress.json is missing or not"),
    (lambda c: (c / "training_progress.json").write_text('{"step": 6, "samples_in_epoch": "six"}'),
     "training_progress.json: the data position (samples_in_epoch: 'six') is not a count of samples"),
    (lambda c: (c / "pytorch_model_fsdp_0" / ".metadata").write_bytes(b"\x80\x04garbage"), ".metadata is not readable"),
])
def test_missing_or_garbage_checkpoint_files_are_refused_naming_them(damage, named, checkpointed_run, tmp_path):
    checkpoint = _without_manifest(checkpointed_run, tmp_path)
    damage(checkpoint)
    with pytest.raises(UsageError, match=re.escape(named)):
        verify_checkpoint(checkpoint, allow_unverified=True)


def test_model_dirs_never_run_their_own_code(tmp_path, checkpointed_run):
    """A model dir whose config names code of its own (`auto_map`): generate,
    evaluate and export refuse it instead of asking or running the code."""
    model_dir = tmp_path / "model"
    shutil.copytree(checkpointed_run / "final", model_dir)
    marker = tmp_path / "code-ran"
    (model_dir / "custom.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                         "from transformers import GPT2Config\n"
                                         "class CustomConfig(GPT2Config):\n    model_type = 'custom-gpt2'\n")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="custom-gpt2", auto_map={"AutoConfig": "custom.CustomConfig"})
    (model_dir / "config.json").write_text(json.dumps(config))
    for command in (["generate", model_dir, "--prompt", "The"], ["evaluate", model_dir],
                    ["export", checkpointed_run, "--output", tmp_path / "out", "--model", model_dir]):
        proc = run_in_process(*command)
        assert proc.returncode == 2, (command, proc.stderr)
        one_error_line(proc.stderr)
    assert not marker.exists()


def test_an_export_killed_earlier_leaves_no_temporary_dir_behind(tmp_path, checkpointed_run):
    dead = 2**22 + 4242  # above the kernel's default pid range: no such process
    leftover = tmp_path / f".out.tmp-{dead}"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    check_ok(run_in_process("export", checkpointed_run, "--output", tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- a run dir is untrusted input: its launch record -------------------------------------------------

def with_launch(checkpointed_run: Path, tmp_path: Path, launch) -> Path:
    """A copy of the shared run whose run_config.yaml records `launch`."""
    import yaml

    run_dir = copy_run(checkpointed_run, tmp_path)
    config = yaml.safe_load((run_dir / "run_config.yaml").read_text())
    (run_dir / "run_config.yaml").write_text(yaml.safe_dump({**config, "launch": launch}, sort_keys=False))
    return run_dir


def recorded(checkpointed_run: Path) -> dict:
    import yaml

    return yaml.safe_load((checkpointed_run / "run_config.yaml").read_text())["launch"]


BAD_LAUNCH_RECORDS = {
    "a program after --no_python": lambda m, launch: {**launch, "launcher_options": [
        "--num_processes", "2", "--no_python", "sh", "-c", f"touch {m}"]},
    "a script to run": lambda m, launch: {**launch, "launcher_options": ["--num_processes", "1", str(m) + ".py"]},
    "another module": lambda m, launch: {**launch, "launcher_options": ["-m", "http.server"]},
    "another accelerate config": lambda m, launch: {**launch, "launcher_options": ["--config_file", str(m)]},
    "a log dir to write": lambda m, launch: {**launch, "launcher_options": ["--log_dir", str(m)]},
    "an option value that is a command": lambda m, launch: {**launch, "launcher_options": [
        "--num_processes", f"2; touch {m}"]},
    "a flag given a value": lambda m, launch: {**launch, "launcher_options": ["--cpu=sh"]},
    "an fsdp option naming a path": lambda m, launch: {**launch, "launcher_options": ["--fsdp_version", str(m)]},
    "a string": lambda m, launch: "accelerate launch sh",
    "a list of strings": lambda m, launch: ["--num_processes", "2"],
    "an unknown key": lambda m, launch: {**launch, "pre_launch_hook": f"touch {m}"},
    "options that are not a list": lambda m, launch: {**launch, "launcher_options": "--num_processes 2"},
    "a process count that is not one": lambda m, launch: {**launch, "num_processes": -3},
    "an mpirun config": lambda m, launch: {**launch, "accelerate_config": {
        **launch["accelerate_config"], "mpirun_config": {"mpirun_hostfile": str(m)}}},
    "a deepspeed hostfile": lambda m, launch: {**launch, "accelerate_config": {
        **launch["accelerate_config"], "deepspeed_config": {"deepspeed_hostfile": str(m)}}},
    "an accelerate setting naming a path": lambda m, launch: {**launch, "accelerate_config": {
        **launch["accelerate_config"], "fsdp_config": {"fsdp_version": str(m)}}},
    "a deepspeed json that writes files": lambda m, launch: {**launch, "deepspeed_config": {
        "train_micro_batch_size_per_gpu": 4, "tensorboard": {"enabled": True, "output_path": str(m)}}},
}


@pytest.mark.parametrize("case", list(BAD_LAUNCH_RECORDS))
def test_resume_replays_only_accelerates_own_settings(case, checkpointed_run, tmp_path):
    """`finetune resume RUN` in a plain shell turns the record into an
    `accelerate launch` command: a record that would run, read or write
    anything else is refused in one line, before any process starts."""
    marker = tmp_path / "ran"
    launch = BAD_LAUNCH_RECORDS[case](marker, recorded(checkpointed_run))
    run_dir = with_launch(checkpointed_run, tmp_path, launch)
    before = snapshot(run_dir)
    proc = run_in_process("resume", run_dir)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = one_error_line(proc.stderr)
    assert "launch record" in line and f"accelerate launch --config_file $(finetune configs --path fsdp) -m finetune resume {run_dir}" in line
    assert "relaunching" not in proc.stdout and not marker.exists() and not Path(str(marker) + ".py").exists()
    assert snapshot(run_dir) == before


def test_a_launch_record_as_accelerate_writes_it_is_replayed(checkpointed_run, tmp_path):
    """What `accelerate config` writes, and launch options of every kind the
    check allows, pass it unchanged."""
    from finetune.launch_record import checked_record

    launch = recorded(checkpointed_run)
    launch = {**launch, "launcher_options": [
        "--num_processes", "2", "--mixed_precision=bf16", "--fsdp_version", "2", "--cpu", "--monitor_interval", "0.5",
        "--num_cpu_threads_per_process", "1", "--gpu_ids", "all"],
        "accelerate_config": {**launch["accelerate_config"], "debug": False, "downcast_bf16": "no", "tpu_env": [],
                              "tpu_use_cluster": False, "tpu_use_sudo": False, "enable_cpu_affinity": False}}
    checked = checked_record(launch, tmp_path)
    assert checked["launcher_options"][:4] == ["--num_processes", "2", "--mixed_precision", "bf16"]  # `=` split
    assert checked == {**launch, "launcher_options": ["--num_processes", "2", "--mixed_precision", "bf16",
                                                      *launch["launcher_options"][3:]]}


def test_every_shipped_config_passes_the_launch_record_check(tmp_path):
    import yaml

    from finetune.launch_record import checked_record

    for config in sorted(CONFIGS.glob("*.yaml")):
        settings = yaml.safe_load(config.read_text())
        launch = {"distributed_type": settings["distributed_type"], "num_processes": settings["num_processes"],
                  "num_machines": settings["num_machines"], "launcher_options": ["--num_processes", "2"],
                  "accelerate_config": settings}
        if "deepspeed_config" in settings:
            launch["deepspeed_config"] = json.loads(
                (CONFIGS / settings["deepspeed_config"]["deepspeed_config_file"]).read_text())
        assert checked_record(launch, tmp_path)["accelerate_config"] == settings, config.name


def test_trust_remote_code_is_never_taken_from_a_file(checkpointed_run, tmp_path, small_corpus):
    """A run config (a resumed run's, or any --config file) that says
    trust_remote_code is refused in one line unless the command line says so too."""
    import yaml

    run_dir = copy_run(checkpointed_run, tmp_path)
    record = yaml.safe_load((run_dir / "run_config.yaml").read_text())
    (run_dir / "run_config.yaml").write_text(yaml.safe_dump({**record, "trust_remote_code": True}, sort_keys=False))
    before = snapshot(run_dir)
    for command in (["resume", run_dir, "--no_relaunch"], ["train", "--config", run_dir / "run_config.yaml",
                                                           "--output_dir", tmp_path / "new"]):
        proc = run_in_process(*command)
        assert proc.returncode == 2, (command, proc.stderr[-2000:])
        line = one_error_line(proc.stderr)
        assert "run_config.yaml sets trust_remote_code" in line and "pass --trust_remote_code if you trust" in line
    assert snapshot(run_dir) == before and not (tmp_path / "new").exists()
    # Said on the command line too, the same file is taken.
    from finetune.config import load_config

    assert load_config(run_dir / "run_config.yaml", {"trust_remote_code": True}).trust_remote_code is True


@pytest.mark.parametrize("link", ["summary.json", "loss.png", "final", "wandb", "checkpoints/step_000012",
                                  "checkpoints/step_000006/model_config", ".heartbeats/rank0"])
def test_a_link_inside_a_run_dir_is_refused_naming_it(link, checkpointed_run, tmp_path):
    """A run dir may come from someone else: a link in it would have a resume
    write, or remove, outside it. Refused in one line naming the link, before
    anything is written, for train --overwrite too."""
    run_dir = copy_run(checkpointed_run, tmp_path)
    outside = tmp_path / "precious"
    (outside / "dir").mkdir(parents=True)
    (outside / "dir" / "keep.txt").write_text("mine")
    (outside / "file").write_text("mine")
    path = run_dir / link
    path.parent.mkdir(parents=True, exist_ok=True)
    target = outside / ("dir" if path.is_dir() else "file")
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.symlink_to(target)
    before, outside_before = snapshot(run_dir), snapshot(outside)
    for command in (["resume", run_dir, "--no_relaunch", "--max_steps", "14"],
                    ["train", "--config", run_dir / "run_config.yaml", "--output_dir", run_dir, "--overwrite",
                     "--max_steps", "2"]):
        proc = run_in_process(*command)
        assert proc.returncode == 2, (command, proc.stderr[-2000:])
        line = one_error_line(proc.stderr)
        assert f"{path} is a symbolic link (to {target})" in line and "never writes or removes through a link" in line
    assert snapshot(run_dir) == before and snapshot(outside) == outside_before


def test_a_run_that_loses_a_new_dir_to_another_removes_nothing(tmp_path, small_corpus, monkeypatch):
    """Two runs started into the same new --output_dir: the one that loses the
    lock ends in one line and leaves the winner's dir, lock and files alone."""
    import finetune.train

    run_dir = tmp_path / "run"
    build_trackers = finetune.train.build_trackers

    def another_run_arrives(*args, **kwargs):  # after this run found the dir new, before it takes the lock
        run_dir.mkdir()
        (run_dir / LOCK_FILE).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                                     "since": "now"}))
        (run_dir / "metrics.jsonl").write_text("theirs\n")
        return build_trackers(*args, **kwargs)

    monkeypatch.setattr(finetune.train, "build_trackers", another_run_arrives)
    proc = run_in_process("train", *common_args(small_corpus), "--max_steps", "1", "--output_dir", run_dir)
    assert proc.returncode == 2
    assert "is in use by a live run" in one_error_line(proc.stderr)
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getppid()
    assert (run_dir / "metrics.jsonl").read_text() == "theirs\n"


def test_overwrite_with_a_preset_trains_the_tokenizer_on_the_new_data(tmp_path, small_corpus):
    """A preset's tokenizer is trained on the run's text: a run started over
    with --overwrite on other text gets the tokenizer of that text, not the old run's."""
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(f"Zebra {i} quux wibble frobnicate {i * 7}." for i in range(400)) + "\n")
    args = ["--model", "tiny-gpt2", "--block_size", "32", "--per_device_batch_size", "2", "--max_steps", "1",
            "--sample_prompt", "", "--max_eval_batches", "1"]
    run_dir, fresh = tmp_path / "run", tmp_path / "fresh"
    check_ok(run_in_process("train", *args, "--dataset", small_corpus, "--output_dir", run_dir))
    old = (run_dir / "tokenizer" / "tokenizer.json").read_text()
    check_ok(run_in_process("train", *args, "--dataset", other, "--output_dir", run_dir, "--overwrite"))
    check_ok(run_in_process("train", *args, "--dataset", other, "--output_dir", fresh))
    new = (run_dir / "tokenizer" / "tokenizer.json").read_text()
    assert new != old and new == (fresh / "tokenizer" / "tokenizer.json").read_text()
    assert (run_dir / "final" / "tokenizer.json").read_text() == new


def test_resume_reads_the_files_its_checkpoint_was_trained_on(tmp_path, monkeypatch):
    """Data and template given as relative paths are recorded absolute, with
    their content's fingerprint: a resume from another dir reads the same
    files, and a file replaced under the same name (rows of another format,
    an edited template) is refused in one line before anything is written."""
    from sft_models import conversations, write_jsonl

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    write_jsonl(work / "chat.jsonl", conversations(48, seed=5))
    template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|endoftext|>' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    (work / "plain.jinja").write_text(template)
    monkeypatch.chdir(work)
    check_ok(run_in_process("train", "--model", "tiny-gpt2", "--dataset", "chat.jsonl", "--chat_template",
                            "plain.jinja", "--max_steps", "2", "--checkpoint_every", "1", "--block_size", "64",
                            "--sample_prompt", "", "--max_eval_batches", "1", "--output_dir", tmp_path / "run"))
    run_dir = tmp_path / "run"
    monkeypatch.chdir(elsewhere)
    check_ok(run_in_process("resume", run_dir, "--max_steps", "3"))  # the same files, found from anywhere

    for name, replace in (("chat.jsonl", lambda p: write_jsonl(p, [{"instruction": r["messages"][-2]["content"],
                                                                    "output": r["messages"][-1]["content"]}
                                                                   for r in conversations(48, seed=5)])),
                          ("plain.jinja", lambda p: p.write_text(template.replace(": ", ":: ")))):
        original = (work / name).read_bytes()
        replace(work / name)
        before = snapshot(run_dir)
        proc = run_in_process("resume", run_dir, "--max_steps", "4")
        assert proc.returncode == 2, proc.stderr[-2000:]
        line = one_error_line(proc.stderr)
        assert f"{work / name} changed since" in line and "put the original back" in line
        assert snapshot(run_dir) == before
        (work / name).write_bytes(original)


@pytest.mark.slow
def test_a_checkpoint_without_its_manifest_is_read_only_when_the_command_line_allows_it(checkpointed_run, tmp_path,
                                                                                        env):
    """A deleted manifest.json would turn verification off: resume and export
    refuse the checkpoint in one line, unless --allow_unverified_checkpoint is
    given, which no run config can grant and the resumed run does not record."""
    import yaml

    run_dir = copy_run(checkpointed_run, tmp_path)
    (run_dir / "checkpoints" / "step_000012" / "manifest.json").unlink()
    before = snapshot(run_dir)
    for command in (["resume", run_dir, "--no_relaunch", "--max_steps", "13"],
                    ["export", run_dir, "--output", tmp_path / "out"]):
        proc = run_in_process(*command)
        assert proc.returncode == 2, proc.stderr[-2000:]
        line = one_error_line(proc.stderr)
        assert "step_000012 has no manifest.json" in line and "pass --allow_unverified_checkpoint" in line
    assert snapshot(run_dir) == before and not (tmp_path / "out").exists()
    record = yaml.safe_load((run_dir / "run_config.yaml").read_text())
    config = tmp_path / "granting.yaml"
    config.write_text(yaml.safe_dump({**record, "allow_unverified_checkpoint": True}))
    proc = run_in_process("train", "--config", config, "--output_dir", run_dir, "--resume_from_checkpoint", "latest")
    assert proc.returncode == 2 and "taken only from the command line" in one_error_line(proc.stderr)

    check_ok(run_in_process("export", run_dir, "--output", tmp_path / "out", "--allow_unverified_checkpoint"))
    # Typed in a plain shell: the permission goes with the relaunch to every rank.
    proc = run_cli(["resume", str(run_dir), "--max_steps", "13", "--allow_unverified_checkpoint"], env, nproc=None)
    check_ok(proc)
    assert "has no manifest.json: its files were not checked" in proc.stdout
    assert "allow_unverified_checkpoint" not in (run_dir / "run_config.yaml").read_text()


def test_a_run_that_recorded_its_data_relative_is_refused_where_the_path_is_gone(checkpointed_run, tmp_path,
                                                                                 monkeypatch):
    """Runs from before absolute paths recorded `--dataset data/corpus.txt`:
    resumed from another dir, that is one line before any process starts."""
    import yaml

    run_dir = copy_run(checkpointed_run, tmp_path)
    for config in (run_dir / "run_config.yaml", *run_dir.glob("checkpoints/*/run_config.yaml")):
        record = yaml.safe_load(config.read_text())
        record.pop("inputs", None)
        config.write_text(yaml.safe_dump({**record, "dataset": "data/corpus.txt"}, sort_keys=False))
    (run_dir / "checkpoints" / "step_000012" / "manifest.json").unlink()  # the record was edited above
    monkeypatch.chdir(tmp_path)
    proc = run_in_process("resume", run_dir, "--allow_unverified_checkpoint")
    assert proc.returncode == 2 and "relaunching" not in proc.stdout
    line = one_error_line(proc.stderr)
    assert f"--dataset data/corpus.txt does not exist from {tmp_path}" in line and "resume from the dir" in line


@pytest.mark.parametrize("option", ["--chat_template", "--config", "--model"])
def test_a_directory_named_as_a_file_is_called_one(option, tmp_path, small_corpus):
    """Not "does not exist": the path is there, and the fix is to name the file in it."""
    named = tmp_path / ("model.gguf" if option == "--model" else "template")
    named.mkdir()
    data = (["--data_format", "chat", "--dataset", write_jsonl(tmp_path / "chat.jsonl", conversations(8))]
            if option == "--chat_template" else ["--dataset", small_corpus])
    proc = run_in_process("train", "--output_dir", tmp_path / "run", *data, option, named)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{named} is a directory, not a file" in one_error_line(proc.stderr)
    assert not (tmp_path / "run").exists()


def test_checkpoint_at_end_false_writes_final_alone_and_resume_says_what_to_do(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    check_ok(run_in_process("train", *common_args(small_corpus), "--max_steps", "2", "--checkpoint_at_end", "false",
                            "--output_dir", run_dir))
    assert (run_dir / "final" / "model.safetensors").is_file() and not (run_dir / "checkpoints").exists()
    proc = run_in_process("resume", run_dir, "--max_steps", "3", "--no_relaunch")
    assert proc.returncode == 2
    assert f"train its final model further: --model {run_dir / 'final'}" in one_error_line(proc.stderr)


def test_a_relaunch_never_imports_from_the_current_dir(tmp_path, env):
    """`finetune resume` typed inside someone else's run dir: a json.py there
    shadows the standard library for any `python -m` started in it. Neither the
    relaunched launcher nor its worker imports it (the calling process itself
    runs with -P, as the console script's path holds no current dir)."""
    (tmp_path / "json.py").write_text("open('IMPORTED', 'w').close()\nfrom importlib import import_module\n")
    script = ("import os, sys; from pathlib import Path; from finetune.launch import relaunch; "
              "sys.exit(relaunch(Path('.'), {'launcher_options': ['--num_processes', '1'], 'accelerate_config': None}, "
              "['configs'], None))")
    proc = subprocess.run([sys.executable, "-P", "-c", script], cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fsdp.yaml" in proc.stdout and not (tmp_path / "IMPORTED").exists()
