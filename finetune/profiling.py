"""`--profile_steps N`: record N optimizer steps with torch.profiler, on every
rank, after two steps of warm-up (the first steps allocate and compile). Writes

    RUN_DIR/profile/rank{R}.json       Chrome trace (open in https://ui.perfetto.dev)
    RUN_DIR/profile/rank{R}.txt        operators by total time
    RUN_DIR/profile/rank{R}_breakdown.json
                                       milliseconds per step in the phases below, and
                                       the peak bytes torch's allocator held for the
                                       steps above what was live when recording began
                                       (activations, gathered parameters, gradients)

The breakdown answers "what is spending the time" from the labels torch,
FSDP and Accelerate put on the training thread (collectives run on their own
threads; what the training thread waits for shows up under FSDP's labels and
c10d's). "other" is the rest of the step: Python, hooks and autograd overhead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

WARMUP_STEPS = 2
# phase -> label prefixes on the training thread; the first matching phase wins.
PHASES = {
    "data_loading": ("enumerate(DataLoader)",),
    "optimizer_step": ("Optimizer.step#",),
    "fsdp_all_gather": ("FSDP::all_gather", "FSDP::forward_prefetch", "FSDP::backward_prefetch"),
    "fsdp_reduce_scatter": ("FSDP::post_backward_reduce",),
    "other_collectives": ("c10d::",),  # DDP's all-reduce, the loss all-reduce, ...
    "forward_backward_compute": ("aten::",),
}


def peak_step_allocation_bytes(prof: profile) -> int:
    """Torch's own accounting (on CPU there is no max_memory_allocated): the
    running sum of the allocations and frees recorded, at its highest."""
    records = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns())
    live = peak = 0
    for record in records:
        live += record.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak


def step_breakdown(prof: profile, steps: int) -> dict[str, float]:
    """Milliseconds per step: the step itself, and each phase's time counted
    once (an event inside an already-counted one is skipped)."""
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    main_thread = next(e.thread for e in events if e.name.startswith("ProfilerStep"))
    phase_us = dict.fromkeys(PHASES, 0.0)
    step_us, counted_until = 0.0, float("-inf")
    # Events on one thread nest, and the counted spans never overlap, so an
    # event inside a counted span starts before the last one ends.
    for e in sorted((e for e in events if e.thread == main_thread), key=lambda e: e.time_range.start):
        start, end = e.time_range.start, e.time_range.end
        if e.name.startswith("ProfilerStep"):
            step_us += end - start
            continue
        phase = next((p for p, prefixes in PHASES.items() if e.name.startswith(prefixes)), None)
        if phase is None or start < counted_until:
            continue
        phase_us[phase] += end - start
        counted_until = end
    per_step = {"step": step_us / steps / 1000, **{p: us / steps / 1000 for p, us in phase_us.items()}}
    per_step["other"] = per_step["step"] - sum(per_step[p] for p in PHASES)
    return per_step


class StepProfiler:
    """A no-op unless steps > 0; call step() after every optimizer step."""

    def __init__(self, steps: int, out_dir: Path, rank: int):
        self.steps, self.out_dir, self.rank = steps, out_dir, rank
        self._profile = None

    def __enter__(self) -> "StepProfiler":
        if self.steps:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._profile = profile(activities=activities, on_trace_ready=self._write, profile_memory=True,
                                    schedule=schedule(wait=0, warmup=WARMUP_STEPS, active=self.steps, repeat=1))
            self._profile.__enter__()
        return self

    def step(self) -> None:
        if self._profile is not None:
            self._profile.step()

    def __exit__(self, *exc) -> None:
        if self._profile is not None:
            self._profile.__exit__(*exc)

    def _write(self, prof: profile) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out_dir / f"rank{self.rank}.json"))
        (self.out_dir / f"rank{self.rank}.txt").write_text(
            prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=80))
        (self.out_dir / f"rank{self.rank}_breakdown.json").write_text(
            json.dumps({"ms_per_step": step_breakdown(prof, self.steps),
                        "peak_step_allocation_bytes": peak_step_allocation_bytes(prof)}, indent=2))
