"""Shared helpers: real `accelerate launch` runs of the CLI on tiny models."""

from __future__ import annotations

import json
import math
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader
import budget
from fork_server import import_and_freeze

REPO = Path(__file__).resolve().parent.parent
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
CONFIGS = REPO / "accelerate_configs"


# The suite runs on two workers, a test file each (scripts/test.sh: pytest-xdist,
# --dist loadfile), handed out in collection order, in two phases:
# - first the tests marked `alone` (the memory-bound runs, whose resident sets
#   are held against tight bounds) on one worker, and beside them, on the other,
#   every file that launches nothing (no test in it is marked `slow`): they need
#   little memory, and the alone runs leave a core idle;
# - then the rest.
# In each phase the costliest files go first (tests/budget.json, each file's
# CPU-seconds in the last recorded run), so that the short ones fill in at the
# end: started last, a long one would leave the other worker idle for minutes.
# A file not measured yet counts as the costliest, so that it never runs last
# unnoticed.


def test_file(item) -> str:
    return item.path.relative_to(REPO / "tests").as_posix()


def launches(fixture_function):
    """Marks a fixture that launches a run: a test that takes it, directly or
    through another fixture, is an end-to-end test (`slow`) wherever it sits."""
    fixture_function.launches = True
    return fixture_function


def takes_a_launch(item) -> bool:
    return any(getattr(definition.func, "launches", False)
               for definitions in item._fixtureinfo.name2fixturedefs.values() for definition in definitions)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers it adds
def pytest_collection_modifyitems(items):
    seconds = budget.recorded()
    unmeasured = max(seconds.values(), default=0) + 1
    items.sort(key=lambda item: -seconds.get(test_file(item), unmeasured))  # stable: a file keeps its own order
    for item in items:
        if takes_a_launch(item):
            item.add_marker("slow")
    launching = {test_file(item) for item in items if item.get_closest_marker("slow")}
    for item in items:
        if test_file(item) not in launching:
            item.add_marker("beside_alone")


# --- CPU-seconds by file (tests/budget.py) ----------------------------------------------------------

# Each test's CPU in three parts: the pytest worker's own, its waited-for
# children's (launched runs with their ranks, and other commands), and its
# forked runs' (as the fork server reports them, launcher and ranks).
CPU_PARTS = ("worker", "launched", "forked")
CPU_SPENT = pytest.StashKey[list]()
FILE_CPU: dict[str, list[float]] = {}


def cpu_spent() -> list[float]:
    t = os.times()
    return [t.user + t.system, t.children_user + t.children_system, ForkServer.cpu_reported]


def timed(item):
    start = cpu_spent()
    yield
    item.stash[CPU_SPENT] = [now - then for now, then in zip(cpu_spent(), start)]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from timed(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from timed(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from timed(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    report.cpu_seconds = item.stash.get(CPU_SPENT, [0.0] * len(CPU_PARTS))  # travels to the controller with the report


def pytest_runtest_logreport(report):
    parts = FILE_CPU.setdefault(report.nodeid.split("::")[0].removeprefix("tests/"), [0.0] * len(CPU_PARTS))
    for i, spent in enumerate(getattr(report, "cpu_seconds", ())):
        parts[i] += spent


def pytest_sessionfinish(session):
    """On the controller, with FINETUNE_CPU_REPORT set (scripts/test.sh): this
    run's CPU-seconds by file, added to the report tests/budget.py reads."""
    report = os.environ.get("FINETUNE_CPU_REPORT")
    if report and not hasattr(session.config, "workerinput"):
        budget.add_to_report(Path(report), FILE_CPU)


STAND_INS = Path(__file__).parent / "stand_ins"  # libraries this machine cannot install, by their interface


def without_stand_ins(python_path: str) -> list[str]:
    """PYTHONPATH's entries but the stand-ins': a forked run puts those on its
    path itself (tests/fork_server.py), the server never having imported them."""
    return [e for e in python_path.split(os.pathsep) if e and not Path(e).is_relative_to(STAND_INS)]


def free_port() -> int:
    """A free port for a launch's store, below the kernel's ephemeral range:
    a port bind(0) handed out could be taken by another run's gloo sockets
    before the launch binds it. Each pytest worker counts through its own block."""
    global _next_port
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    block = PORT_BLOCK_SIZE * (worker + 1)
    first = max(1024, low - block)
    for _ in range(PORT_BLOCK_SIZE):
        port = first + _next_port % PORT_BLOCK_SIZE
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + PORT_BLOCK_SIZE}")


PORT_BLOCK_SIZE = 2000
_next_port = 0


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory, worker_id) -> Path:
    """One for the session's workers, as their runs share one fork server (it
    imported the libraries with these caches' paths). The caches are safe to
    share: their writers replace whole files."""
    return made_once(tmp_path_factory, worker_id, "cache", lambda path: None)


@pytest.fixture(scope="session")
def env(cache_dir) -> dict:
    e = dict(os.environ)
    e.update(FINETUNE_CACHE=str(cache_dir / "finetune"), HF_DATASETS_CACHE=str(cache_dir / "datasets"),
             HF_MODULES_CACHE=str(cache_dir / "modules"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
             TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return e


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory, worker_id, env) -> Path:
    """About 120 kB of the built-in corpus as a .txt file, a paragraph per document: real text, quick to tokenize.
    One file for both workers: the runs made once (checkpointed_run) recorded its path."""
    from finetune.data.builtin import build_stdlib_corpus

    os.environ["FINETUNE_CACHE"] = env["FINETUNE_CACHE"]

    def write(root: Path) -> None:
        docs = [json.loads(line)["text"].replace("\n", " ") for line in build_stdlib_corpus().read_text().splitlines()]
        text, size = [], 0
        for doc in docs:
            text.append(doc)
            size += len(doc)
            if size > 120_000:
                break
        (root / "corpus.txt").write_text("\n\n".join(text) + "\n")  # a paragraph per document

    return made_once(tmp_path_factory, worker_id, "data", write) / "corpus.txt"


def launch_options(nproc: int, config: str, mixed_precision: str | None, extra_launch: Sequence[str]) -> list[str]:
    options = ["--config_file", str(CONFIGS / config), "--num_processes", str(nproc),
               "--main_process_port", str(free_port()), *extra_launch]
    return options + ["--mixed_precision", mixed_precision] if mixed_precision else options


def run_cli(args: list[str], env: dict, nproc: int | None = 2, config: str = "fsdp.yaml",
            mixed_precision: str | None = None, timeout: int = 300, extra_launch: Sequence[str] = (),
            warm: bool = False) -> subprocess.CompletedProcess:
    """`accelerate launch ... -m finetune ARGS` with nproc processes, or plain
    `python -m finetune ARGS` when nproc is None. `warm`: forked from the
    tests' fork server (ForkServer), for a test that needs a run, not a launch."""
    args = [str(a) for a in args]
    if warm and not ForkServer.imports_differ(env):
        options = None if nproc is None else launch_options(nproc, config, mixed_precision, extra_launch)
        return ForkServer.run_together([(args, options)], env, timeout)[0]
    if nproc is None:
        cmd = [sys.executable, "-m", "finetune", *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch",
               *launch_options(nproc, config, mixed_precision, extra_launch), "-m", "finetune", *args]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def run_cli_together(runs: list[tuple[list[str], dict]], env: dict, timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Independent warm runs (ARGS, run_cli's launch keywords) at the same
    time: one run's ranks leave cores idle (one loads while the other waits,
    the main process saves alone) that another fills."""
    commands = [([str(a) for a in args], launch_options(launch.get("nproc", 2), launch.get("config", "fsdp.yaml"),
                                                        launch.get("mixed_precision"), launch.get("extra_launch", ())))
                for args, launch in runs]
    if ForkServer.imports_differ(env):
        return [run_cli(args, env, timeout=timeout, **launch) for args, launch in runs]
    return ForkServer.run_together(commands, env, timeout)


class ForkServer:
    """The client of tests/fork_server.py, one server for the session's
    workers: a run forked from it is the run `accelerate launch` with the same
    options, environment and working dir would make (torchrun's agent starts,
    watches and ends its ranks), without each rank's ~5 s of interpreter
    start-up and imports. The server imported the libraries with the session's
    environment: a run whose environment differs in what a library reads when
    it loads (IMPORT_TIME) is launched afresh instead."""

    IMPORT_TIME = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TQDM_", "PYTORCH_", "OMP_", "MKL_",
                   "PYTHON", "DS_", "LD_")
    home: Path | None = None  # the session's dir shared by its workers (set by a session fixture)
    owner: int = 0  # the process the server lives as long as: the pytest controller
    cpu_reported = 0.0  # the CPU-seconds of this worker's forked runs so far (conftest.cpu_spent)
    started_with: dict | None = None  # the server's environment, once this worker has asked

    @classmethod
    def imports_differ(cls, env: dict) -> bool:
        server = cls.server_env(env)
        keys = {k for k in (*env, *server) if k.startswith(cls.IMPORT_TIME)}
        return any(env.get(k) != server.get(k) for k in keys if k != "PYTHONPATH") or \
            without_stand_ins(env.get("PYTHONPATH", "")) != without_stand_ins(server.get("PYTHONPATH", ""))

    @classmethod
    def server_env(cls, env: dict) -> dict:
        """The environment the server runs with; the first worker to ask starts it with `env`."""
        if cls.started_with is None:
            cls.started_with = cls.start(env)
        return cls.started_with

    @classmethod
    def start(cls, env: dict) -> dict:
        from filelock import FileLock

        socket_path, recorded = cls.home / "fork-server.sock", cls.home / "fork-server.env.json"
        with FileLock(str(cls.home / "fork-server.lock")):
            if not recorded.exists():
                recorded.write_text(json.dumps(env))
                log = (cls.home / "fork-server.log").open("w")
                # The padding holds the launch command lines the launchers write over it.
                subprocess.Popen([sys.executable, "-m", "tests.fork_server", str(socket_path), str(cls.owner),
                                  "x" * 32768], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        return json.loads(recorded.read_text())

    @classmethod
    def connect(cls) -> socket.socket:
        path, deadline = cls.home / "fork-server.sock", time.monotonic() + 180
        while not path.exists():  # the server imports first
            if time.monotonic() > deadline:
                raise RuntimeError("the fork server did not start:\n" + (cls.home / "fork-server.log").read_text())
            time.sleep(0.1)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(path))
        return conn

    @classmethod
    def run_together(cls, commands: list[tuple[list[str], list[str] | None]], env: dict, timeout: float,
                     cwd: Path = REPO) -> list[subprocess.CompletedProcess]:
        """Each command (ARGS, accelerate launch OPTIONS or None for one plain
        process) forked at once, in `cwd` (the repo's dir, as run_cli runs); their results in order."""
        runs = [cls.submit(args, options, env, cwd) for args, options in commands]
        deadline = time.monotonic() + timeout
        return [cls.collect(*run, deadline, timeout) for run in runs]

    @classmethod
    def run_launch_line(cls, words: list[str], env: dict, timeout: float,
                        cwd: Path = REPO) -> subprocess.CompletedProcess:
        """`accelerate launch OPTIONS -m finetune ARGS`, as words, forked on a free port."""
        module = words.index("-m")
        assert words[:2] == ["accelerate", "launch"] and words[module + 1] == "finetune", words
        options = [*words[2:module], "--main_process_port", str(free_port())]
        return cls.run_together([(words[module + 2:], options)], env, timeout, cwd)[0]

    @classmethod
    def submit(cls, args: list[str], options: list[str] | None, env: dict,
               cwd: Path = REPO) -> tuple[list[str], Path, socket.socket]:
        """Starts a run; its dir gets the ranks' pids (pid-RANK) as they start."""
        cls.server_env(env)  # started if it is not yet
        run_dir = Path(tempfile.mkdtemp(prefix="forked-", dir=cls.home))
        conn = cls.connect()
        conn.sendall(json.dumps({"argv": args, "options": options, "env": env, "cwd": str(cwd),
                                 "run_dir": str(run_dir)}).encode() + b"\n")
        return args, run_dir, conn

    @classmethod
    def collect(cls, args: list[str], run_dir: Path, conn: socket.socket,
                deadline: float, timeout: float) -> subprocess.CompletedProcess:
        answer = b""
        with conn:
            while not answer.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([conn], [], [], left)[0]:
                    cls.kill(run_dir)
                    # Where each rank was: the end of its log says which step it reached.
                    logs = cls.read(run_dir, sorted(p.name for p in run_dir.glob("err-*")) + ["launcher.log"])
                    sys.stderr.write(f"the run's logs when it timed out:\n{logs[-6000:]}\n")
                    raise subprocess.TimeoutExpired(args, timeout)
                chunk = conn.recv(65536)
                if not chunk:
                    raise RuntimeError(f"the fork server's launcher died: {cls.read(run_dir, ['launcher.log'])}")
                answer += chunk
        result = json.loads(answer)
        cls.cpu_reported += result["cpu"]
        codes = result["codes"]
        ranks = range(len(codes))
        # A rank's own exit code (the first that failed on its own, not by the agent's signal), as
        # `python -m finetune` would leave it.
        code = next((c for c in codes if c > 0), next((c for c in codes if c), 0))
        stderr = cls.read(run_dir, [f"err-{r}" for r in ranks])
        if any(c < 0 for c in codes) or "error" in result:  # ended from outside: the launcher says why
            stderr += cls.read(run_dir, ["launcher.log"]) + result.get("error", "")
        proc = subprocess.CompletedProcess(args, code, cls.read(run_dir, [f"out-{r}" for r in ranks]), stderr)
        shutil.rmtree(run_dir, ignore_errors=True)
        return proc

    @staticmethod
    def read(run_dir: Path, names: list[str]) -> str:
        return "".join((run_dir / n).read_text(errors="replace") for n in names if (run_dir / n).exists())

    @staticmethod
    def kill(run_dir: Path) -> None:
        for pid_file in run_dir.glob("pid-*"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


@pytest.fixture(scope="session", autouse=True)
def _imports_out_of_the_collector():
    """The libraries most tests import, frozen out of the collector's full
    passes, which otherwise walk them each time an in-process test's
    allocations trigger one (a test that parses the standard library took
    twice as long)."""
    import_and_freeze(("accelerate", "datasets", "transformers.modeling_utils"))


@pytest.fixture(scope="session", autouse=True)
def _fork_server_home(tmp_path_factory, worker_id):
    """Where the workers find the one fork server (started by the first run that needs it)."""
    shared = tmp_path_factory.getbasetemp()
    ForkServer.home = shared.parent if worker_id != "master" else shared
    ForkServer.owner = os.getppid() if worker_id != "master" else os.getpid()
    ForkServer.started_with = None


def stopped_by_sigterm(args: list, env: dict, checkpoint: Path) -> str:
    """`accelerate launch` of fsdp.yaml on 2 processes in fp32 running
    `finetune ARGS`, stopped as a scheduler stops a job: SIGTERM to its whole
    process group once `checkpoint` exists. Its stderr, which says where it stopped."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs/fsdp.yaml"),
         "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()),
         "-m", "finetune", *map(str, args)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 240
    while not checkpoint.is_dir():
        assert launcher.poll() is None and time.time() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.05)
    os.killpg(launcher.pid, signal.SIGTERM)
    return launcher.communicate(timeout=120)[1]


def run_in_process(*args) -> subprocess.CompletedProcess:
    """`finetune ARGS` through the same `main` the console script calls, in this
    process (no interpreter start-up): for the single-process commands."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from finetune.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def check_ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        causes = [line for line in proc.stderr.splitlines()
                  if any(word in line for word in ("Error", "error:", "terminate", "what()", "abort"))]
        raise AssertionError(f"exit {proc.returncode}\n--- causes\n" + "\n".join(causes[:40]) +
                             f"\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-4000:]}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def eval_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval_loss" in r]


def dcp_elements_per_file(shard_dir: Path, skip: set[str]) -> dict[str, int]:
    """Parameter elements stored in each .distcp file, from the DCP metadata."""
    md = FileSystemReader(str(shard_dir)).read_metadata()
    per_file: Counter = Counter()
    for index, info in md.storage_data.items():
        if index.fqn in skip:
            continue
        chunk = md.state_dict_metadata[index.fqn].chunks[index.index]
        per_file[info.relative_path] += math.prod(chunk.sizes)
    return dict(per_file)


def common_args(corpus: Path) -> list[str]:
    """tiny-gpt2 on the small corpus, quick evaluation, no sample."""
    return ["--model", "tiny-gpt2", "--dataset", str(corpus), "--block_size", "64", "--per_device_batch_size", "4",
            "--sample_prompt", "", "--max_eval_batches", "1", "--learning_rate", "3e-3"]


def made_once(tmp_path_factory, worker_id: str, name: str, make: Callable[[Path], None]) -> Path:
    """A dir that `make` fills once per session, for every xdist worker: the
    first worker to get here makes it under a lock, the others wait and read
    it (the tests that take it must leave it as it is)."""
    if worker_id == "master":  # one process: nothing to share
        path = tmp_path_factory.mktemp(name)
        make(path)
        return path
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # this session's, shared by its workers
    path, done = shared / name, shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # a worker that failed making it
            path.mkdir()
            make(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
@launches
def checkpointed_run(tmp_path_factory, worker_id, env, small_corpus) -> Path:
    """fp32, 2-process FSDP, 12 steps, a checkpoint every 6. A launch of its own:
    test_memory_planner holds its peak resident set against the planner's."""
    def train(path: Path) -> None:
        check_ok(run_cli(["train", *common_args(small_corpus), "--max_steps", "12", "--checkpoint_every", "6",
                          "--output_dir", str(path / "run")], env, mixed_precision="no"))

    return made_once(tmp_path_factory, worker_id, "checkpointed", train) / "run"


# --- the docs' commands ---------------------------------------------------------------------------

def doc_pages() -> list[Path]:
    """README.md, then the pages of docs/ in the site's order (mkdocs.yml's nav)."""
    import yaml

    def names(items):
        for item in items:
            for value in (item.values() if isinstance(item, dict) else [item]):
                yield from names(value) if isinstance(value, list) else [value]

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    return [REPO / "README.md", *(REPO / "docs" / name for name in names(nav))]


def docs_commands() -> list[str]:
    """Every command in the bash blocks of the README and the docs, in reading
    order, continuation lines joined, comments dropped, each once."""
    commands = []
    for page in doc_pages():
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for command in block.replace("\\\n", " ").splitlines():
                command = re.sub(r"\s+#.*$", "", command).strip()
                if command and not command.startswith("#"):
                    commands.append(re.sub(r"\s+", " ", command))
    return list(dict.fromkeys(commands))


def output_dir_of(words: list[str]) -> str | None:
    return words[words.index("--output_dir") + 1] if "--output_dir" in words else None


def how_docs_check(command: str, later: list[str], work: Path) -> str:
    """What the docs test does with a command:
    - "run": as written, for real: a command that shows a behaviour, and a
      training run a later command goes on from (resumes, exports, trains on);
    - "dry_run": a training launch, as written plus --dry_run (its options,
      paths and launch checked; through accelerate's own launch with forked
      ranks, tests/fork_server.py, where no shell syntax needs bash): a run nothing later needs, or one that needs
      the network, a GPU, the quickstart's model or the reader's own files
      (stood in for by small files);
    - "parse": parsed by its program's own parser: a second machine, a
      benchmark, an lm-eval score of a model made elsewhere;
    - "script" / "pip" / "mkdocs": the script exists / the extras exist / a
      MkDocs command (the site is built by test_docs);
    - "shell": a line that sets up the user's shell (`source .venv/bin/activate`):
      every later command runs after it, as in the user's terminal."""
    words = command.split()
    if words[0] == "bash":
        return "script"
    if words[0] == "source":
        return "shell"
    if words[:2] == ["pip", "install"]:
        return "pip"
    if words[0] == "mkdocs":
        return "mkdocs"
    if words[:2] == ["python", "scripts/bench.py"] or "--machine_rank" in words:
        return "parse"
    if words[:2] == ["accelerate", "launch"]:
        out = output_dir_of(words)
        needed = out and not (work / out).exists() and any(out in c.split()[1:] or f"{out}/" in c for c in later)
        runnable = not any(mark in command for mark in ("path/to/", "$(", "--peft qlora", "--model gpt2 "))
        return "run" if needed and runnable and "--dry_run" not in words else "dry_run"
    if words[0] == "finetune" and "--tasks" in words and "$(" in command:
        return "parse"
    return "run"


def stand_in(placeholder: str, work: Path) -> None:
    """A small real thing at a `path/to/...` placeholder (or the quickstart's
    run): a data file or dir by its name, a small chat model otherwise."""
    from sft_models import conversations, save_chat_model, write_jsonl

    if ".py:" in placeholder:  # a reward function: FILE.py:NAME
        file, _, function = placeholder.rpartition(":")
        (work / file).parent.mkdir(parents=True, exist_ok=True)
        (work / file).write_text(f"def {function}(prompts, completions, completion_ids, **columns):\n"
                                 "    return [1.0 for _ in completions]\n")
        return
    path = work / placeholder
    name = path.name
    if "*" in name:  # a glob: one file it matches
        path = path.with_name(name.replace("*", "0000"))
        name = path.name
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if name == "vlm" or "vlm_run" in placeholder:  # a vision-language model: a tiny LLaVA with its processor
        from vlm_models import save_vlm_model

        save_vlm_model(path, "llava")
        return
    if "photos" in name or "photos" in path.parent.name:  # image chat rows (TRL's format) and their images
        from finetune.data.shapes import build_shapes

        drawn = build_shapes(count=8, cache=work / ".stand-in-photos")
        base = path.parent if name.endswith(".jsonl") else path.parent.parent
        data = base / "photos.jsonl"
        shutil.copytree(drawn.parent / "images", base / "photos", dirs_exist_ok=True)
        data.write_text(drawn.read_text().replace('"images/', '"photos/'))
        return
    rows = conversations(8) if any(word in name for word in ("chat", "conversation")) else [
        {"text": f"note {i}: the model reads a file", "body": f"note {i}: the model reads a file"} for i in range(8)]
    if placeholder.endswith("/"):
        path.mkdir()
        write_jsonl(path / "train.jsonl", rows)
    elif name.endswith(".jsonl"):
        write_jsonl(path, rows)
    elif name.endswith(".jsonl.zst"):
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    elif name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif "reward-model" in name:  # a reward model's dir: the chat model under a one-score head
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        save_chat_model(path)
        AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).save_pretrained(path)
        AutoTokenizer.from_pretrained(path).save_pretrained(path)
    elif "moe" in name.lower():  # a mixture of experts, as the MoE page's commands need one
        from sft_models import save_family_model

        save_family_model(path, "qwen3_moe")
    else:  # one small chat model, made once per dir and copied to each model placeholder
        made = work / ".stand-in-model"
        if not made.is_dir():
            save_chat_model(made)
        shutil.copytree(made, path)


def placeholders(command: str) -> list[str]:
    found = re.findall(r"path/to/[^\s'\"]+", command)
    if "outputs/quickstart-*/final" in command:
        found.append("outputs/quickstart-docs/final")
    return found


@pytest.fixture(scope="session")
@launches
def docs_workdir(tmp_path_factory, worker_id, env) -> Path:
    """Runs the docs' commands in order in a fresh dir, as a user would copy them:
    `accelerate launch` for real, with nothing added but a free port (so in the
    config's bf16 on any CPU), `finetune ...` through the console script's `main`."""
    return made_once(tmp_path_factory, worker_id, "docs", lambda work: run_docs_commands(work, env))


def run_docs_commands(work: Path, env: dict) -> None:
    from contextlib import chdir

    (work / "accelerate_configs").symlink_to(CONFIGS)
    # The venv the README's set-up scripts make (the suite's own stands in for
    # it: test_quickstart runs the quickstart itself), in a new shell that has
    # not entered it: only the README's own words (`source ...`) find its commands.
    (work / ".venv").symlink_to(sys.prefix)
    shell_env = new_shell_env(env)
    prelude: list[str] = []
    commands = docs_commands()
    for i, command in enumerate(commands):
        how = how_docs_check(command, commands[i + 1:], work)
        for placeholder in placeholders(command):
            stand_in(placeholder, work)
        words = shlex.split(command)
        if how in ("script", "pip", "mkdocs", "parse"):
            check_as_parsed(how, command, words)
            continue
        if how == "shell":
            prelude.append(command)
            continue
        in_shell = ["bash", "-c", "\n".join([*prelude, "set -e"]) + "\n"]
        if how == "dry_run" or words[:2] == ["accelerate", "launch"]:
            assert prelude, f"{command!r} comes before the README says how a new shell finds its commands"
            # QLoRA's options and paths are checked on CPU as the tests run QLoRA here.
            extra = {"FINETUNE_QLORA_ON_CPU": "1"} if "--peft qlora" in command else {}
            if how == "dry_run" and "$" not in command and not ForkServer.imports_differ({**shell_env, **extra}):
                # Its options through accelerate's own launch, with ranks forked: the commands that
                # really launch (above all the first) show that the shell finds `accelerate`.
                dry_run = [*words, *([] if "--dry_run" in words else ["--dry_run"])]
                proc = ForkServer.run_launch_line(dry_run, {**shell_env, **extra}, 300, cwd=work)
            else:
                launched = command.replace("accelerate launch ", f"accelerate launch --main_process_port {free_port()} ", 1)
                launched += " --dry_run" if how == "dry_run" and "--dry_run" not in words else ""
                in_shell[-1] += launched
                proc = subprocess.run(in_shell, env={**shell_env, **extra}, cwd=work, capture_output=True,
                                      text=True, timeout=300)
            if how == "dry_run":
                assert proc.returncode == 0 and "dry run: " in proc.stdout, (command, proc.stderr[-3000:])
        elif words[:2] == ["finetune", "resume"]:  # relaunches itself: a process of its own, in the tests' env
            proc = subprocess.run([sys.executable, "-m", "finetune", *words[1:]], env=env, cwd=work,
                                  capture_output=True, text=True, timeout=300)
        elif words[0] == "finetune" and "$(" not in command:
            with chdir(work):
                proc = run_in_process(*words[1:])
        else:  # python -c, grep, a command substitution: through the shell, as typed
            in_shell[-1] += command
            proc = subprocess.run(in_shell, env=shell_env, cwd=work, capture_output=True, text=True, timeout=300)
        check_ok(proc)
        with (work / "commands.log").open("a") as log:
            log.write(f"$ {command}\n{proc.stdout}\n")


def new_shell_env(env: dict) -> dict:
    """`env` as a new shell has it: no virtual environment entered, none of
    the suite's on PATH."""
    venv_bin = str(Path(sys.executable).parent)
    path = [d for d in env.get("PATH", os.defpath).split(os.pathsep) if d and d != venv_bin]
    return {**{k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")},
            "PATH": os.pathsep.join(path)}


def check_as_parsed(how: str, command: str, words: list[str]) -> None:
    """What a command that is not run is held to. A command substitution
    stands for a path (a script it runs must exist)."""
    for script in re.findall(r"\$\(bash (\S+)\)", command):
        assert (REPO / script).is_file(), command
    words = shlex.split(re.sub(r"\$\([^)]*\)", "MODEL_DIR", command))
    if how == "script":
        assert (REPO / words[1]).is_file(), command
    elif how == "pip":
        import tomllib

        extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for spec in words[2:]:
            if spec.startswith(".["):
                assert set(spec[2:-1].split(",")) <= set(extras), (command, sorted(extras))
            elif spec.startswith("torch=="):  # the build the set-up scripts install
                assert f"FINETUNE_TORCH_VERSION:-{spec[7:]}" in (REPO / "scripts" / "_env.sh").read_text(), command
    elif how == "mkdocs":
        assert words[1] in ("serve", "build"), command
    elif words[:2] == ["python", "scripts/bench.py"]:
        import importlib.util

        spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        bench.build_parser().parse_args(words[2:])
    elif words[:2] == ["accelerate", "launch"]:
        from accelerate.commands.launch import launch_command_parser

        from finetune.cli import build_parser

        launch = launch_command_parser().parse_args(words[2:])
        assert (REPO / launch.config_file).is_file() and launch.module and launch.training_script == "finetune", command
        build_parser().parse_args(launch.training_script_args)
    else:  # a finetune command whose model comes from elsewhere
        from finetune.cli import build_parser

        build_parser().parse_args(words[1:])
