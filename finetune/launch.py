"""How a run was launched, recorded under `launch:` in its run_config.yaml
(the facts a relaunch of the run needs).

Under `accelerate launch`, every worker is a child of the launcher process;
its command line (Linux: /proc/PID/cmdline) holds the launch options, and the
accelerate config they name is read and recorded whole, so that a relaunch
need not depend on that file still being where it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

# Launcher options that depend on the moment, not on the run: a relaunch picks them afresh.
NOT_REPLAYED = {"--main_process_port", "--config_file"}


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


def record() -> dict | None:
    """What run_config.yaml keeps under `launch`: the launcher's options and the
    content of its accelerate config."""
    found = launcher_options()
    if found is None:
        return None
    options, cwd = found
    replayed, skip = [], False
    for a in options:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in NOT_REPLAYED:
            skip = "=" not in a
            continue
        replayed.append(a)
    config_file = _option(options, "--config_file")
    config = yaml.safe_load((cwd / config_file).read_text()) if config_file else None
    return {"launcher_options": replayed, "accelerate_config": config}
