"""Chaos rounds: one 2-process FSDP run, interrupted again and again by a signal
to a random process (either rank or the launcher) at a random moment after a
new checkpoint (mid-step, mid-save or mid-rename), each round resuming `latest`.

    python scripts/chaos.py [--rounds 24] [--seed 20261125] [--output_dir outputs/chaos]

What each signal must do:
- SIGKILL: every process of the run gone within a minute (a killed launcher
  takes its ranks with it); the newest complete checkpoint verifies.
- SIGTERM: the run stops after the step in flight, saves a checkpoint there and
  prints one `stopped:` line naming it.
- SIGSTOP: a stopped rank is noticed by the others within --ddp_timeout and the
  run ends with one line naming it; a stopped launcher is continued (SIGCONT)
  a few seconds later and the run goes on, then is ended with SIGKILL.
After the last round the run is resumed to its end, and an uninterrupted run of
the same steps is made: every step must be logged exactly once, with the
uninterrupted run's loss (fp32: equal to 1e-5; a constant learning rate, so
that the schedule does not depend on --max_steps). The rounds, their outcomes and
the comparison go to OUTPUT_DIR/chaos.json and chaos.md. Outside the test suite
(minutes); tests/e2e/test_trust.py runs three SIGKILL rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.checkpoint import verify_checkpoint  # noqa: E402
from finetune.run_dir import checkpoint_step, complete_checkpoints  # noqa: E402

VICTIMS = ("launcher", "rank 0", "rank 1")
SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP)
DDP_TIMEOUT_S = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(args, run_dir: Path, max_steps: int, resume: bool) -> list[str]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "accelerate_configs" / "fsdp.yaml"), "--num_processes", "2", "--main_process_port",
               str(free_port()), "--mixed_precision", "no", "-m", "finetune", "train", "--model", args.model,
               "--dataset", args.dataset, "--block_size", "64", "--per_device_batch_size", "4", "--sample_prompt", "",
               "--max_eval_batches", "1", "--learning_rate", "3e-3", "--lr_scheduler_type", "constant",
               "--max_steps", str(max_steps),
               "--checkpoint_every", "2", "--ddp_timeout", str(DDP_TIMEOUT_S), "--output_dir", str(run_dir)]
    return command + (["--resume_from_checkpoint", "latest"] if resume else [])


def rank_pids(launcher: int, run_dir: Path) -> list[int]:
    """The pids of ranks 0 and 1 of this launch: each rank writes its pid into
    its heartbeat file; only the workers (`-m finetune`) below this launcher count."""
    table = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    children: dict[int, list[tuple[int, str]]] = {}
    for line in table:
        pid, ppid, command = line.split(None, 2)
        children.setdefault(int(ppid), []).append((int(pid), command))
    found, todo = [], [launcher]
    while todo:
        for pid, command in children.get(todo.pop(), []):
            todo.append(pid)
            if "-m finetune" in command and "accelerate" not in command:
                found.append(pid)
    by_rank = [int((run_dir / ".heartbeats" / f"rank{rank}").read_text().split()[0]) for rank in (0, 1)]
    if sorted(by_rank) != sorted(found):
        raise SystemExit(f"the heartbeats name pids {by_rank}, the launcher's workers are {found}")
    return by_rank


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def newest_step(run_dir: Path) -> int:
    done = complete_checkpoints(run_dir)
    return checkpoint_step(done[-1]) if done else 0


def one_round(args, rng: random.Random, run_dir: Path, index: int, victim: str, sig: signal.Signals) -> dict:
    before = newest_step(run_dir)
    log = run_dir.parent / f"round{index:02d}.log"
    with log.open("w") as out:
        launcher = subprocess.Popen(train_command(args, run_dir, 100_000, resume=index > 0), cwd=REPO,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while newest_step(run_dir) <= before:  # a new checkpoint: progress to keep
            if launcher.poll() is not None or time.time() > deadline:
                raise SystemExit(f"round {index}: no new checkpoint; see {log}")
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 1.5))
        ranks = rank_pids(launcher.pid, run_dir)
        target = {"launcher": launcher.pid, "rank 0": ranks[0], "rank 1": ranks[1]}[victim]
        sent_at = time.time()
        os.kill(target, sig)
        if sig == signal.SIGSTOP and victim == "launcher":
            time.sleep(rng.uniform(1.0, 3.0))
            os.kill(target, signal.SIGCONT)
            resumed_from = newest_step(run_dir)
            while newest_step(run_dir) <= resumed_from:  # the run went on
                if launcher.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"round {index}: the run did not go on after SIGCONT; see {log}")
                time.sleep(0.01)
            os.kill(launcher.pid, signal.SIGKILL)
        deadline = time.time() + 90
        while any(running(pid) for pid in [launcher.pid, *ranks]):
            if time.time() > deadline:
                raise SystemExit(f"round {index}: processes outlived the {sig.name} of the {victim}; see {log}")
            launcher.poll()
            time.sleep(0.05)
        seconds_to_end = time.time() - sent_at
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    text = log.read_text()
    newest = complete_checkpoints(run_dir)[-1]
    progress = verify_checkpoint(newest)
    outcome = {"round": index, "signal": sig.name, "victim": victim, "checkpoint_before": before,
               "checkpoint_after": progress.step, "seconds_to_end": round(seconds_to_end, 1),
               "launcher_exit": launcher.returncode}
    if progress.step <= before:
        raise SystemExit(f"round {index}: no new checkpoint survived the {sig.name} of the {victim}")
    if sig == signal.SIGTERM:
        stopped = [line for line in text.splitlines() if "stopped: SIGTERM at step" in line]
        if len(stopped) != 1 or int(re.search(r"at step (\d+)", stopped[0]).group(1)) != progress.step:
            raise SystemExit(f"round {index}: SIGTERM to the {victim}: expected one `stopped:` line naming "
                             f"step {progress.step}; see {log}")
        outcome["line"] = stopped[0][stopped[0].index("stopped:"):]
    if sig == signal.SIGSTOP and victim != "launcher":
        errors = [line for line in text.splitlines() if "stopped answering" in line]
        if len(errors) != 1:
            raise SystemExit(f"round {index}: a stopped {victim} was not named in one line; see {log}")
        outcome["line"] = errors[0][errors[0].index("error:"):] if "error:" in errors[0] else errors[0]
    print(f"round {index:2d}: {sig.name:7s} to the {victim:8s} -> checkpoint step {before} -> {progress.step}, "
          f"all processes gone {seconds_to_end:.1f} s after the signal", flush=True)
    return outcome


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--seed", type=int, default=20261125)
    parser.add_argument("--model", default="tiny-gpt2")
    parser.add_argument("--dataset", default="builtin")
    parser.add_argument("--output_dir", type=Path, default=REPO / "outputs" / "chaos")
    args = parser.parse_args()
    if args.output_dir.exists():
        raise SystemExit(f"{args.output_dir} exists; pass another --output_dir")
    args.output_dir.mkdir(parents=True)
    run_dir, reference_dir = args.output_dir / "run", args.output_dir / "uninterrupted"
    rng = random.Random(args.seed)
    # Each (signal, victim) pair in turn, as evenly as the rounds allow, in a seeded order.
    plan = [(victim, sig) for sig in SIGNALS for victim in VICTIMS]
    plan = [plan[i % len(plan)] for i in range(args.rounds)]
    rng.shuffle(plan)
    start = time.time()
    rounds = [one_round(args, rng, run_dir, i, victim, sig) for i, (victim, sig) in enumerate(plan)]

    end = newest_step(run_dir) + 2
    for directory, resume in ((run_dir, True), (reference_dir, False)):
        proc = subprocess.run(train_command(args, directory, end, resume), cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the run to step {end} in {directory} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    chaotic, reference = losses(run_dir), dict(losses(reference_dir))
    steps = [step for step, _ in chaotic]
    if steps != list(range(1, end + 1)):
        raise SystemExit(f"steps logged: {steps}; expected each of 1..{end} once")
    largest = max(abs(loss - reference[step]) for step, loss in chaotic)
    if largest > 1e-5:
        raise SystemExit(f"the interrupted run's losses differ from the uninterrupted run's by up to {largest:.2e}")

    result = {"rounds": rounds, "steps": end, "largest_loss_difference": largest, "seed": args.seed,
              "minutes": round((time.time() - start) / 60, 1)}
    (args.output_dir / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"{len(rounds)} rounds (seed {args.seed}), {result['minutes']} minutes; the run then resumed to step "
             f"{end}: every step logged once, losses within {largest:.1e} of an uninterrupted run.", "",
             "| round | signal | to | checkpoint before -> after | all processes gone after (s) |", "|---|---|---|---|---|"]
    lines += [f"| {r['round']} | {r['signal']} | {r['victim']} | {r['checkpoint_before']} -> {r['checkpoint_after']} "
              f"| {r['seconds_to_end']} |" for r in rounds]
    (args.output_dir / "chaos.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
