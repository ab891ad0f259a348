"""The tests' fork server: one process that imports torch, transformers,
accelerate, datasets and finetune once, from which every warm run of the suite
(conftest.run_cli(..., warm=True), both pytest workers) is forked.

A run's request (argv, environment, working dir, accelerate launch options)
comes over a Unix socket. The server forks a launcher for it, which runs
accelerate's own `launch_command` on those options, as `accelerate launch`
does: the config is read and validated there, torchrun's agent starts the
ranks, meets them at their own port, watches them and ends them all when one
fails. Only the start of a rank differs: instead of exec'ing
`python -u -m finetune ARGS` (about 5 s of interpreter start-up and imports on
2 cores), the launcher forks, and the child becomes that process: the agent's
environment, its own session, fresh standard streams, `python -m finetune`'s
argv and import path, torch's initial random state; nothing of a process group
exists before the rank makes its own. The ranks read the launcher's command
line (/proc/PPID/cmdline, finetune/launch.py) as the launch's: the launcher
writes it into its argv area, which the server holds padded for that.

A launcher and its ranks die with the server (PR_SET_PDEATHSIG), the server
with the pytest session that started it. What a run cost (the rusage of the
launcher and of every rank) comes back with its exit codes.

    python -m tests.fork_server SOCKET OWNER_PID PADDING
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import resource
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

# What a run imports, imported once here (the rest a run imports itself):
# among them what a run loads only on its way (evaluate for the eval metric,
# matplotlib for loss.png), about a third of a tiny run's CPU otherwise.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "transformers", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.llama.modeling_llama", "accelerate", "accelerate.commands.launch", "datasets",
           "safetensors.torch", "torch.distributed.checkpoint.state_dict", "scipy.io", "evaluate",
           "matplotlib.pyplot", "matplotlib.backends.backend_agg", "finetune.cli", "finetune.train",
           "finetune.tasks.causal_lm", "finetune.tasks.image_classification", "finetune.objectives.pairs",
           "finetune.objectives.rollouts", "finetune.inference", "finetune.export", "finetune.gguf_export")
PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def set_command_line(argv: list[str]) -> None:
    """This process's /proc/self/cmdline, written into its argv area (which
    the server's padding argument made large enough)."""
    stat = Path("/proc/self/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: proc(5) fields 48 and 49
    text = b"".join(a.encode() + b"\0" for a in argv)
    if len(text) > end - start:
        raise ValueError(f"a command line of {len(text)} bytes: the server holds {end - start}")
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


# --- a rank ---------------------------------------------------------------------------------------

class ForkedRank:
    """What subprocess.Popen gives torchrun's agent, for a rank forked from
    this process instead of executed: pid, poll, wait, returncode, signals."""

    def __init__(self, args: list[str], env: dict[str, str], out: int, err: int, on_exit):
        self.args, self.returncode, self.on_exit = args, None, on_exit
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                code = become_rank(args, env, out, err)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except (OSError, ValueError):
                        pass
                os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                self.on_exit(self, usage)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def become_rank(args: list[str], env: dict[str, str], out: int, err: int) -> int:
    """In the forked child: the process `args` (`python [-u] -m finetune ...`)
    would be, then run it."""
    os.setsid()  # as torchrun starts its workers: the agent ends a rank by its process group
    die_with_parent()
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.closerange(3, min(os.sysconf("SC_OPEN_MAX"), 65536))  # as Popen(close_fds=True) leaves a child
    # -u, as torchrun runs them: unbuffered binary, write-through text.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    words = [a for a in args[1:] if a != "-u"]
    if words[:1] != ["-m"]:
        raise ValueError(f"the fork server runs `python -m MODULE`, not {args}")
    module, argv = words[1], words[2:]
    fresh_process_state(env)
    if not env.get("PYTHONSAFEPATH"):
        sys.path[0] = os.getcwd()  # what `python -m` puts first
    # PYTHONPATH's entries the server did not start with (the tests' stand-ins, of libraries it never imported),
    # after the first as python puts them.
    sys.path[1:1] = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e and e not in sys.path]
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0  # finetune's entry ends the process itself; a module that returns exits 0


INITIAL_TORCH_STATE = None


def fresh_process_state(env: dict[str, str]) -> None:
    """What a new interpreter starts with and the server's imports changed:
    torch's generator, Python's hash-independent RNGs, the thread count
    torch read from OMP_NUM_THREADS when it loaded."""
    import random

    import torch

    torch.default_generator.set_state(INITIAL_TORCH_STATE)
    random.seed()
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))


# --- a launcher -----------------------------------------------------------------------------------

class Launcher:
    """One request: `accelerate launch OPTIONS -m finetune ARGV` (or
    `python -m finetune ARGV` without options) with ranks forked, in the
    working dir RUN_DIR gets their streams: out-RANK, err-RANK, launcher.log."""

    def __init__(self, request: dict):
        self.request = request
        self.run_dir = Path(request["run_dir"])
        self.codes: dict[int, int] = {}
        self.cpu = 0.0
        self.ranks: list[ForkedRank] = []

    def rank_ended(self, rank: ForkedRank, usage) -> None:
        self.codes[rank.local_rank] = rank.returncode
        self.cpu += usage.ru_utime + usage.ru_stime

    def popen(self, real_popen):
        """subprocess.Popen for the agent (or accelerate's one-process launcher):
        a finetune rank forked, anything else executed."""
        def popen(args, *a, env=None, stdout=None, stderr=None, **kw):
            words = [str(x) for x in args] if isinstance(args, (list, tuple)) else []
            if len(words) < 3 or "-m" not in words[:3]:
                return real_popen(args, *a, env=env, stdout=stdout, stderr=stderr, **kw)
            local_rank = int((env or os.environ).get("LOCAL_RANK", "0"))
            out = os.open(self.run_dir / f"out-{local_rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            err = os.open(self.run_dir / f"err-{local_rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            rank = ForkedRank(words, dict(env if env is not None else os.environ), out, err, self.rank_ended)
            os.close(out)
            os.close(err)
            rank.local_rank = local_rank
            (self.run_dir / f"pid-{local_rank}").write_text(str(rank.pid))
            self.ranks.append(rank)
            return rank
        return popen

    def run(self) -> dict:
        request = self.request
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        log = os.open(self.run_dir / "launcher.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        import subprocess as subprocess_module

        import torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler as handler

        real_popen = subprocess_module.Popen
        subprocess_module.Popen = handler.Popen = self.popen(real_popen)
        module = [sys.executable, "-u", "-m", "finetune", *request["argv"]]
        try:
            if request["options"] is None:  # `python -m finetune ARGV`: one process, no launcher
                self.popen(real_popen)(module, env=dict(os.environ)).wait()
            else:
                self.launch(request["options"], request["argv"])
        except SystemExit:
            pass
        except BaseException:  # the agent's ChildFailedError and its like: the ranks' codes say it
            traceback.print_exc()
        for rank in self.ranks:
            rank.wait()
        own = resource.getrusage(resource.RUSAGE_SELF)
        return {"codes": [self.codes.get(i, 1) for i in range(len(self.ranks))],
                "cpu": self.cpu + own.ru_utime + own.ru_stime}

    def launch(self, options: list[str], argv: list[str]) -> None:
        from accelerate.commands.launch import launch_command, launch_command_parser

        set_command_line([sys.executable, "-m", "accelerate.commands.launch", *options, "-m", "finetune", *argv])
        launch_command(launch_command_parser().parse_args([*options, "-m", "finetune", *argv]))


def supervise(conn: socket.socket) -> None:
    """The forked launcher's life: read the request, run it, answer, exit."""
    die_with_parent()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    with conn.makefile("rb") as reader:
        request = json.loads(reader.readline())
    Path(request["run_dir"], "pid-launcher").write_text(str(os.getpid()))
    try:
        answer = Launcher(request).run()
    except BaseException:
        answer = {"codes": [1], "cpu": 0.0, "error": traceback.format_exc()}
    conn.sendall(json.dumps(answer).encode() + b"\n")
    conn.close()


# --- the server -----------------------------------------------------------------------------------

def import_and_freeze(names: tuple[str, ...]) -> None:
    """Imports `names` as a finetune command would (torchao kept out of
    transformers first), then freezes every object so far out of the garbage
    collector: they live as long as the process, and its full passes would
    walk them all (half a million) each time. The server's and the pytest
    workers' start."""
    import gc
    import importlib

    from finetune.cli import keep_torchao_out_of_transformers

    keep_torchao_out_of_transformers()
    for name in names:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()


def serve(socket_path: Path, owner: int) -> None:
    global INITIAL_TORCH_STATE
    os.environ.setdefault("TQDM_DISABLE", "1")  # a rank's stderr is a file: tqdm reads this when it loads
    import torch

    INITIAL_TORCH_STATE = torch.default_generator.get_state()
    import matplotlib

    matplotlib.use("Agg")  # as finetune.report does
    import_and_freeze(PRELOAD)  # a rank's gc.collect() then neither walks them nor copies the pages they are on
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    scratch = socket_path.with_name(socket_path.name + ".tmp")
    scratch.unlink(missing_ok=True)
    listener.bind(str(scratch))
    listener.listen(64)
    scratch.rename(socket_path)  # whoever sees the path can connect
    while alive(owner):
        while True:  # reap the launchers that are done
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        conn, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            try:
                supervise(conn)
            finally:
                os._exit(0)
        conn.close()
    socket_path.unlink(missing_ok=True)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]))
    os._exit(0)
