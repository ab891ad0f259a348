"""The rank side of the tests' warm ranks (conftest.WarmRanks): started once by a
real `accelerate launch` (so with the environment, the process group and the
parent command line that launch gives a rank), or as one plain process like
`python -m finetune`, then runs `finetune ARGS`
commands one after another, each as `main` would run in a fresh rank, with no
interpreter start-up or imports in between (about 5 s a launch on 2 cores).

The test process writes `cmd-N.json` into the queue dir and wakes the ranks
through their FIFOs (`wake-RANK`); every rank runs it with its stdout and
stderr in `out-N-RANK` / `err-N-RANK`, answers with `done-N-RANK` holding the
exit code, and wakes the test process (`wake-tests`). Waiting blocks on the
FIFOs: polling ranks cost a core a tenth of the time when a worker holds a
dozen of them. What a run leaves behind in the process
is set back before the next: accelerate's singletons, the environment and the
signal handlers. The process group stays: `destroy_process_group` of the
default group is a no-op here, as under a fork launch.

    accelerate launch ... -m tests.warm_ranks QUEUE_DIR
    python -m tests.warm_ranks QUEUE_DIR
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text(text)
    scratch.replace(path)


def keep_the_process_group() -> None:
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_all_but_the_default(group=None):
        if group is not None:
            destroy(group)
    dist.destroy_process_group = destroy_all_but_the_default


def forget_the_last_run(environment: dict[str, str], handlers: dict) -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.clear()
    os.environ.update(environment)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def run_one(argv: list[str], out: Path, err: Path) -> int:
    from finetune.cli import main

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with out.open("w") as out_file, err.open("w") as err_file:
        os.dup2(out_file.fileno(), 1)
        os.dup2(err_file.fileno(), 2)
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return code


def wait_for(path: Path, fifo: int, still_needed) -> bool:
    """Until `path` exists (True), or `still_needed()` says no more (False),
    blocked on `fifo`, which whoever makes `path` writes a byte to."""
    while not path.exists():
        if not still_needed():
            return False
        if select.select([fifo], [], [], 1.0)[0]:
            try:
                os.read(fifo, 4096)
            except BlockingIOError:
                pass
    return True


def wake(fifo: Path) -> None:
    """A byte to whoever waits on `fifo`; nobody has it open yet: they look at the files before they wait."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader yet
        return
    try:
        os.write(fd, b"x")
    except BlockingIOError:  # full: a wake-up is already waiting
        pass
    finally:
        os.close(fd)


def open_fifo(path: Path) -> int:
    """Read side; O_RDWR so that opening never blocks and it never reads as closed."""
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serve(queue: Path) -> None:
    rank = os.environ.get("RANK", "0")  # none without a launcher: one process
    environment = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    keep_the_process_group()
    owner = int((queue / "owner").read_text())  # the test process: its ranks end with it, however it ends
    wake_me = open_fifo(queue / f"wake-{rank}")  # before the first look at the queue: no wake-up is missed
    n = 0
    while True:
        command = queue / f"cmd-{n}.json"
        # Gone: the launcher (this rank was handed to init) or the tests.
        if not wait_for(command, wake_me, lambda: os.getppid() != 1 and alive(owner)):
            return
        request = json.loads(command.read_text())
        if request.get("exit"):
            return
        os.environ.update(request.get("env", {}))  # this command's own; forget_the_last_run sets them back
        code = run_one(request["argv"], queue / f"out-{n}-{rank}", queue / f"err-{n}-{rank}")
        forget_the_last_run(environment, handlers)
        write_atomically(queue / f"done-{n}-{rank}", str(code))
        wake(queue / "wake-tests")
        n += 1


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)
