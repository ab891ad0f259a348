"""How a run was launched, recorded under `launch:` in its run_config.yaml, and
the relaunch that lets `finetune resume RUN`, typed in a plain shell, continue
the run as it was launched: the commands we print then work as printed.

Under `accelerate launch`, every worker is a child of the launcher process;
its command line (Linux: /proc/PID/cmdline) holds the launch options, and the
accelerate config they name is read and recorded whole, so that a relaunch
need not depend on that file still being where it was.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from finetune.errors import UsageError

if TYPE_CHECKING:
    from finetune.backends.base import Backend

# Launcher options that depend on the moment, not on the run (a relaunch picks
# them afresh), or name a file whose content is recorded instead.
NOT_REPLAYED = {"--main_process_port", "--config_file", "--deepspeed_config_file"}

# Where the workers of a relaunch leave their exit codes: the launcher itself
# turns any failure into exit code 1, and a script should see the workers' own.
EXIT_STATUS_DIR = "FINETUNE_EXIT_STATUS_DIR"


def launcher_options() -> tuple[list[str], Path] | None:
    """The options the parent `accelerate launch` was given (up to `-m`), and
    its working directory; None when the parent is not accelerate launch."""
    parent = os.getppid()
    try:
        argv = [a.decode() for a in Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0") if a]
        cwd = Path(os.readlink(f"/proc/{parent}/cwd"))
    except OSError:
        return None
    starts = [i for i, a in enumerate(argv) if a == "accelerate.commands.launch"
              or (a == "launch" and i > 0 and argv[i - 1].endswith("accelerate"))]
    if not starts:
        return None
    options = argv[starts[0] + 1:]
    return (options[:options.index("-m")] if "-m" in options else options), cwd


def _option(options: list[str], name: str) -> str | None:
    for i, a in enumerate(options):
        if a == name and i + 1 < len(options):
            return options[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def without_options(options: list[str], names: set[str]) -> list[str]:
    """`options` less the named ones and their values (`--name value` or `--name=value`)."""
    kept, skip = [], False
    for a in options:
        if skip:
            skip = False
            continue
        if a.split("=", 1)[0] in names:
            skip = "=" not in a
            continue
        kept.append(a)
    return kept


def record(distributed_type: str, num_processes: int, backend: Backend) -> dict:
    """What run_config.yaml keeps under `launch`: the distributed type, process
    and machine counts, and under `accelerate launch` its options and the
    content of its accelerate config and of the files it names."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
    facts = {"distributed_type": distributed_type, "num_processes": num_processes,
             "num_machines": max(1, num_processes // max(1, local))}
    found = launcher_options()
    if found is None:
        return facts
    options, cwd = found
    config_file = _option(options, "--config_file")
    config = yaml.safe_load((cwd / config_file).read_text()) if config_file else None
    return {**facts, "launcher_options": without_options(options, NOT_REPLAYED), "accelerate_config": config,
            **backend.launch_files()}


def under_a_launcher() -> bool:
    """Started by torchrun or accelerate launch (whose one-process mode sets no LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ or launcher_options() is not None


def relaunch_command(run_dir: Path, launch: dict, argv: list[str], num_processes: int | None,
                     config_file: Path) -> list[str] | None:
    """`accelerate launch` as the run recorded it, running `finetune ARGV`; None
    when the run was not started by accelerate launch (resume it in this process)."""
    if "launcher_options" not in launch:
        return None
    if launch.get("num_machines", 1) > 1:
        raise UsageError(f"{run_dir} ran on {launch['num_machines']} machines; resume it the way it was launched, "
                         "on every machine (scripts/slurm/finetune.sbatch does with --resume_from_checkpoint auto)")
    options = launch["launcher_options"]
    if num_processes is not None:
        options = [*without_options(options, {"--num_processes"}), "--num_processes", str(num_processes)]
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if launch.get("accelerate_config") is not None:
        command += ["--config_file", str(config_file)]
    return [*command, *options, "--main_process_port", str(free_port()), "-m", "finetune", *argv]


def write_recorded_configs(launch: dict, scratch: Path) -> Path:
    """The recorded accelerate config (and the files it named) as files in
    `scratch`, not the (maybe moved or edited) originals; returns the
    accelerate config's path."""
    config_file = scratch / "accelerate_config.yaml"
    config = launch.get("accelerate_config")
    if config is None:
        return config_file
    from finetune.backends import for_launch_config  # only here: every command imports this module

    config = for_launch_config(config).write_launch_files(launch, config, scratch)
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    return config_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relaunch(run_dir: Path, launch: dict, argv: list[str], num_processes: int | None) -> int | None:
    """Run `finetune ARGV` under `accelerate launch` as the run was launched and
    return the workers' exit code; None when there is nothing to relaunch."""
    with tempfile.TemporaryDirectory(prefix="finetune-relaunch-") as scratch:
        config_file = write_recorded_configs(launch, Path(scratch))
        command = relaunch_command(run_dir, launch, argv, num_processes, config_file)
        if command is None:
            return None
        shown = shlex.join(["accelerate", "launch", *command[3:]]).replace(str(config_file), "RECORDED_CONFIG")
        print(f"relaunching as the run was launched: {shown}", flush=True)
        # The current dir (maybe the run dir, someone else's) never leads the
        # import path of the launcher or the workers, as `python -m` would put
        # it: a json.py there would run (Python 3.11+; finetune/__main__.py on 3.10).
        launcher = subprocess.Popen(command, env={**os.environ, EXIT_STATUS_DIR: scratch, "PYTHONSAFEPATH": "1"})
        # Ctrl-C reaches the launcher and the workers from the terminal, and they
        # stop the run cleanly; this process only waits for them. A SIGTERM or
        # SIGHUP sent to this process alone is passed on.
        previous = {sig: signal.signal(sig, (lambda signum, frame: launcher.send_signal(signum))
                                       if sig != signal.SIGINT else signal.SIG_IGN)
                    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            launcher_code = launcher.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return workers_exit_code(Path(scratch), launcher_code)


def workers_exit_code(scratch: Path, launcher_code: int) -> int:
    """Rank 0's exit code when it left one, else another rank's, else the launcher's."""
    codes = {int(p.name.removeprefix("rank")): int(p.read_text()) for p in scratch.glob("rank*")}
    failed = [code for _, code in sorted(codes.items()) if code != 0]
    if launcher_code == 0 or not failed:
        return launcher_code
    return codes[0] if codes.get(0) else failed[0]


def leave_exit_code(code: int) -> None:
    """Under a relaunch, tell the relaunching process how this rank ended."""
    if scratch := os.environ.get(EXIT_STATUS_DIR):
        try:
            (Path(scratch) / f"rank{os.environ.get('RANK', '0')}").write_text(str(code))
        except OSError:
            pass  # the relaunching process is gone; nobody is left to tell
