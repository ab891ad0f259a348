"""The training loop, the same for every task (what differs comes from
finetune/tasks):

    train(cfg)
      setup_run   data and model, prepare, resume or a first evaluation
      fit         until total_steps: train_step (one optimizer step over its
                  micro-batches), then after_step (the shared loss, logging,
                  epoch end, evaluation, checkpoint, stop request)
      finish      final evaluation and checkpoint, the consolidated model, summary

FSDP, mixed precision and process count come from the accelerate config; this
file never branches on them.
"""

from __future__ import annotations

import gc
import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from finetune.checkpoint import CheckpointManager, TrainingProgress
from finetune.config import TrainConfig, defaults_note, resume_changes
from finetune.cpu_threads import use_cpu_threads
from finetune.backends import requested_backend
from finetune.backends.accelerator import build_accelerator
from finetune.backends.base import Backend, ShardReport
from finetune.backends.mesh import data_parallel_size, tensor_parallel_size
from finetune.collectives import WriteFailed, broadcast_from_main, on_every_rank
from finetune.data.fingerprint import check_same_inputs, input_fingerprints
from finetune.data.stream import EpochBatches, SourceTally, StreamBatches
from finetune.errors import Stopped, UsageError
from finetune.hardware import slow_bf16_warning
from finetune.host_memory import HostMemory, resident_bytes
from finetune.launch import record as launch_record
from finetune.liveness import Heartbeats, is_collective_timeout
from finetune.lock import RunLock, empty_run_dir, remove_new_run_dir
from finetune.final_model import write_final_model
from finetune.model_card import RunRecord, write_model_card
from finetune.optim import LRSchedule, build_optimizer, build_scheduler
from finetune.parameters import full_numel
from finetune.profiling import StepProfiler
from finetune.signals import NoSignal
from finetune.run_dir import (checkpoint_step, complete_checkpoints, failed_start, has_results, resolve_checkpoint,
                              saved_config, starts_afresh)
from finetune.report import (build_trackers, run_summary, evaluation_line, grouped_names, plain_logs, quiet_library_bars,
                             read_evaluations, read_metrics, say, step_line, truncate_metrics, write_summary)
from finetune.stopping import StopSignals, leave_the_launch
from finetune.tasks import check_preset_task
from finetune.objectives import build_task
from finetune.tasks.base import Task, TaskData


LONG_EVALUATION_BATCHES = 500  # an evaluation this long is said before it starts


@dataclass
class Run:
    """What a run holds from setup to finish."""
    cfg: TrainConfig
    accelerator: Accelerator
    backend: Backend
    task: Task
    data: TaskData
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    train_batches: EpochBatches | StreamBatches
    sources: SourceTally
    eval_loader: DataLoader
    checkpoints: CheckpointManager
    stop: StopSignals
    heartbeats: Heartbeats
    total_steps: int
    progress: TrainingProgress
    shards: ShardReport
    fsdp_units: int
    evals: list[tuple[int, dict]] = field(default_factory=list)  # (step, result) of every evaluation
    host: HostMemory = field(default_factory=HostMemory)          # this rank's resident set, phase by phase
    load_peak_rss: int = 0                                        # the highest resident set until `prepare` returned
    last_loss: float | None = None                                # stays None when a resume has no step left
    state: dict[str, dict[str, int]] = field(default_factory=dict)  # measured right after the first optimizer step
    train_seconds: float = 0.0
    plain_logs: bool = False                                      # a line per logged step instead of a bar
    cpu_threads: int = 1                                          # torch's threads in each process
    bar: tqdm = field(default_factory=lambda: tqdm(disable=True))  # fit() shows the real one
    no_signal: list[NoSignal] = field(default_factory=list)  # the task's checks; fit() sets them
    profiler: StepProfiler = field(default_factory=lambda: StepProfiler(0, Path(), 0))

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.output_dir)

    def log(self, row: dict) -> None:
        self.accelerator.log(grouped_names(row), step=row["step"])

    def evaluate(self) -> dict:
        try:
            batches = len(self.eval_loader)
        except TypeError:  # rows without a length
            batches = 0
        if batches >= LONG_EVALUATION_BATCHES:
            say(self.accelerator, f"evaluating {batches:,} held-out batches at step {self.progress.step} "
                                  "(--max_eval_samples takes fewer)")
        result = self.task.evaluate(self.model, self.eval_loader, self.accelerator)
        self.backend.after_evaluation(self.model)
        self.log({"step": self.progress.step, "epoch": self.progress.epoch, **result})
        self.evals.append((self.progress.step, result))
        say(self.accelerator, evaluation_line(self.progress.step, result, self.task.metric_name))
        return result


@dataclass
class StepResult:
    loss: float         # the step's loss: summed over the global batch, divided by its number of targets
    units: float        # tokens (not padding) or samples in the global batch
    stop_votes: float   # ranks that were asked to stop
    grad_norm: float
    lr: float           # the learning rate the step used
    seconds: float      # the step's data loading and compute
    epoch_end: bool     # the step used the epoch's last micro-batch
    resident_bytes_per_rank: list[int] = field(default_factory=list)  # each rank's RSS after the step
    metrics: dict[str, float] = field(default_factory=dict)  # the task's step metrics, means over the targets


def train(cfg: TrainConfig) -> dict:
    backend = requested_backend()
    backend.import_libraries()
    host = HostMemory()
    check_preset_task(cfg.model, cfg.task)
    task = build_task(cfg)
    task.peft.check_supported_here()
    run_dir = Path(cfg.output_dir)
    new_dir = not run_dir.exists()
    afresh = starts_afresh(run_dir)  # (a resume from another run's checkpoint may write into a new dir)
    new_parents = [p for p in run_dir.absolute().parents if not p.exists()]  # made with the run dir
    trackers = build_trackers(cfg.report_to, run_dir, resume=bool(cfg.resume_from_checkpoint))
    accelerator = build_accelerator(cfg.gradient_accumulation_steps, cfg.seed, trackers,
                                    run_dir, timeout_s=cfg.ddp_timeout, backend=backend)
    heartbeats = Heartbeats(run_dir, accelerator, cfg.ddp_timeout)
    if plain_logs(cfg.log_format) or not accelerator.is_main_process:
        quiet_library_bars()  # only the main process shows progress, and only on a terminal
    lock = RunLock(run_dir, accelerator)
    try:
        with lock, StopSignals() as stop:
            if cfg.resume_from_checkpoint in ("", "auto") and accelerator.is_main_process and failed_start(run_dir):
                accelerator.print(f"note: {run_dir} holds a run that failed before its first checkpoint: starting it afresh")
                empty_run_dir(run_dir)
            return run_to_the_end(setup_run(cfg, task, accelerator, backend, stop, heartbeats, host))
    except BaseException as e:
        # Whatever fails before the first step (bad input, a reward, the first
        # forward) leaves no run dir: only a dir that held nothing to keep, and
        # that this run locked. One that trained keeps its logs, and is a failed
        # start (run_dir.failed_start) until its first checkpoint: not in the way.
        if afresh and lock.taken and accelerator.is_main_process and not has_results(run_dir) \
                and not any("loss" in row for row in read_metrics(run_dir / "metrics.jsonl")):
            remove_new_run_dir(run_dir, new_parents, keep_dir=not new_dir)
        if isinstance(e, RuntimeError) and is_collective_timeout(e):
            raise heartbeats.lost(e) from None
        raise
    finally:
        # Free the wrapped model while the process group is alive: a DDP reducer
        # destroyed after its gloo group hangs in the group's destructor. The
        # frames of an exception in flight hold the run (and its model) too.
        if (in_flight := sys.exc_info()[2]) is not None:
            traceback.clear_frames(in_flight)
        accelerator.free_memory()
        gc.collect()
        backend.end_training(accelerator)


def run_to_the_end(run: Run) -> dict:
    """The run is this frame's alone: it is freed when the frame ends, before
    `train` tears down the process group."""
    fit(run)
    return finish(run)


# --- setup ----------------------------------------------------------------------------------------

def setup_run(cfg: TrainConfig, task: Task, accelerator: Accelerator, backend: Backend, stop: StopSignals,
              heartbeats: Heartbeats, host: HostMemory) -> Run:
    cpu_threads, _ = use_cpu_threads()
    if warning := slow_bf16_warning(accelerator):
        accelerator.print(warning)
    run_dir = Path(cfg.output_dir)
    resume_from = resolve_checkpoint(run_dir, cfg.resume_from_checkpoint) if cfg.resume_from_checkpoint else None
    new_length = False
    saved = saved_config(resume_from) if resume_from else {}  # the config the checkpoint was written with
    # The files the options name, read through once (by the main process) for every rank.
    inputs = input_fingerprints(cfg, task.frozen_reference()) if accelerator.is_main_process else None
    inputs = broadcast_from_main(inputs) if accelerator.num_processes > 1 else inputs
    if resume_from:
        new_length = any(saved.get(name, getattr(cfg, name)) != getattr(cfg, name)
                         for name in ("max_steps", "num_epochs"))
        for change in resume_changes(saved, cfg):
            accelerator.print(f"resume changes {change}")
        check_same_inputs(saved.get("inputs"), inputs, cfg, resume_from)
    set_seed(cfg.seed)  # model init and dropout; a resume then restores every rank's RNG from its checkpoint

    model, data = task.build(accelerator, backend, run_dir)
    train_loader, eval_loader = prepare_loaders(cfg, accelerator, task, data)
    if data.stream is not None:
        train_batches = StreamBatches(data.stream, accelerator, cfg.per_device_batch_size, data.collate)
    else:
        train_batches = EpochBatches(train_loader, accelerator, task.rows_per_batch * data_parallel_size(accelerator))
    train_batches = task.training_batches(train_batches)
    sources = SourceTally(data.source_names or cfg.sources, cfg.source_weights)
    total_steps = cfg.max_steps or cfg.num_epochs * train_batches.steps_per_epoch(cfg.gradient_accumulation_steps)
    backend.check_model(accelerator, model)
    backend.split_layers(accelerator, model)
    optimizer = build_optimizer(model, cfg)
    backend.fit_to_run(accelerator, cfg.per_device_batch_size, cfg.max_grad_norm)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, build_scheduler(optimizer, cfg, total_steps))
    backend.after_prepare(model)
    if task.own_shards is not None:
        task.own_shards.fill(model, task.peft.added_by_peft)  # each rank reads the rows of the weights it keeps
        accelerator.print(f"each rank read only its shard of the weights of {cfg.model}")
    task.prepared(accelerator, backend, model)  # after the weights: it may run the model (--precompute_reference)
    load_peak_rss = host.peak()

    checkpoints = CheckpointManager(
        accelerator, model, run_dir, every=cfg.checkpoint_every, every_epochs=cfg.checkpoint_every_epochs,
        keep_last=cfg.keep_last, at_end=cfg.checkpoint_at_end,
        config_yaml=f"# {defaults_note(cfg)}\n" + yaml.safe_dump(
            {**cfg.recorded(), "launch": launch_record(accelerator.distributed_type.value, accelerator.num_processes,
                                                      backend),
             "inputs": inputs},
            sort_keys=False), tokenizer=data.saved_with_model, peft=task.peft, backend=backend,
        data=[train_batches, sources],
        allow_unverified=cfg.allow_unverified_checkpoint)
    run = Run(cfg=cfg, accelerator=accelerator, backend=backend, task=task, data=data, model=model, optimizer=optimizer,
              schedule=LRSchedule.for_config(scheduler, optimizer, cfg), train_batches=train_batches, sources=sources,
              eval_loader=eval_loader, checkpoints=checkpoints, stop=stop, heartbeats=heartbeats,
              total_steps=total_steps,
              progress=TrainingProgress(world_size=accelerator.num_processes),
              shards=backend.verify_sharded(model, accelerator), fsdp_units=backend.units(model), host=host,
              load_peak_rss=load_peak_rss,
              plain_logs=plain_logs(cfg.log_format), cpu_threads=cpu_threads)
    measure_state_after_first_step(run)
    if resume_from:
        resume(run, resume_from, new_length)
    start_writing(run, resume_from)
    if not resume_from:
        run.evaluate()
    return run


def prepare_loaders(cfg: TrainConfig, accelerator: Accelerator, task: Task,
                    data: TaskData) -> tuple[DataLoader, DataLoader]:
    """Loaders split between the data-parallel ranks (tensor-parallel ranks
    share a batch), refused when a rank would get no batch. A stream has no
    training loader: each rank reads its own part (StreamBatches)."""
    data_parallel = data_parallel_size(accelerator)
    eval_loader = DataLoader(data.validation, batch_size=cfg.per_device_eval_batch_size or cfg.per_device_batch_size,
                             collate_fn=data.eval_collate or data.collate, generator=torch.Generator().manual_seed(cfg.seed))
    if data.stream is not None:
        if data_parallel != accelerator.num_processes:
            raise UsageError("--streaming splits the data by rank, and tensor-parallel ranks share one batch; stream "
                             "with an FSDP or DDP config (fsdp.yaml, hsdp.yaml), or drop --streaming")
        return None, accelerator.prepare(eval_loader)
    if len(data.train) < task.rows_per_batch * data_parallel:
        held_out = f", hold out less (--validation_split {cfg.validation_split})" if cfg.validation_split else ""
        raise UsageError(f"{len(data.train)} training samples are fewer than one batch on every rank "
                         f"({task.rows_per_batch} x {data_parallel}); add data{held_out} or lower "
                         f"{task.batch_size_options}")
    # Each loader draws from its own generator: a new iterator (every epoch, every
    # evaluation, the first after a resume) would otherwise take a number from
    # the global RNG and shift every dropout mask after it.
    train_loader = DataLoader(data.train, batch_size=task.rows_per_batch, shuffle=True, drop_last=True,
                              collate_fn=data.collate, generator=torch.Generator().manual_seed(cfg.seed),
                              num_workers=cfg.dataloader_num_workers, worker_init_fn=leave_the_launch)
    return accelerator.prepare(train_loader, eval_loader)


def measure_state_after_first_step(run: Run) -> None:
    """Parameters, gradients and optimizer state are all alive right after the
    first optimizer step (before the gradients are freed): measure them then,
    once, from a hook instead of from the loop. A backend that frees them
    as it steps is measured by `run_summary` instead."""
    if not run.backend.measures_state_after_first_step:
        return

    def measure(*_):
        run.state = run.backend.state(run.model, stepping_optimizer(run))
        handle.remove()

    handle = stepping_optimizer(run).register_step_post_hook(measure)


def stepping_optimizer(run: Run) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's wrapper (and an engine's own, such as ZeRO's)."""
    optimizer = run.optimizer
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def resume(run: Run, checkpoint: Path, new_length: bool) -> None:
    run.progress = run.checkpoints.load(checkpoint, run.model, run.cfg.seed)
    if run.accelerator.is_main_process:  # rows logged after that checkpoint belong to the lost part of the run
        truncate_metrics(run.run_dir / "metrics.jsonl", run.progress.step)
        run.evals = read_evaluations(run.run_dir / "metrics.jsonl")  # the summary keeps the run's first
    run.accelerator.print(f"resumed from {checkpoint} at step {run.progress.step}")
    steps_left = run.progress.step < run.total_steps
    if new_length and steps_left and (change := run.schedule.follow_new_length(run.progress.step)):
        run.accelerator.print(change)
    if change := run.schedule.rescale_peak(run.cfg.learning_rate):
        run.accelerator.print(change)


def start_writing(run: Run, resumed_from: Path | None) -> None:
    """Everything is checked: from here on the run writes into its dir."""
    acc = run.accelerator
    try:  # first: a tracker that cannot start (a bad MLFLOW_TRACKING_URI, ...) leaves the run as it was
        on_every_rank(acc, lambda: acc.init_trackers(run.run_dir.name, config=run.cfg.tracker_values()), errors=(Exception,))
    except WriteFailed as e:
        raise UsageError(f"--report_to {run.cfg.report_to}: a tracker could not start ({e}); fix its settings "
                         "(MLFLOW_TRACKING_URI, WANDB_MODE, ...) or drop it from --report_to") from None
    run.checkpoints.start_timeline(run.progress.step, resumed_from)
    if acc.is_main_process:
        (run.run_dir / "run_config.yaml").write_text(run.checkpoints.config_yaml)
        if resumed_from is None:
            (run.run_dir / "metrics.jsonl").unlink(missing_ok=True)
    layout = run.backend.layout_line(acc, run.shards, run.fsdp_units)
    if (trainable := trainable_params(run.model)) < run.shards.total_params:
        layout += run.task.peft.trainable_note(trainable)
    acc.print(f"{layout}; {run.data.description}; {run.total_steps} steps; {run.cpu_threads} CPU thread(s) per process")


def trainable_params(model: torch.nn.Module) -> int:
    return sum(full_numel(p) for p in model.parameters() if p.requires_grad)  # a DTensor's numel is the whole tensor's


# --- the loop -------------------------------------------------------------------------------------

def fit(run: Run) -> None:
    run.model.train()  # from_pretrained returns a model in eval mode: dropout off
    run.no_signal = run.task.no_signal_checks()
    start = time.perf_counter()
    with tqdm(total=run.total_steps, initial=run.progress.step, desc="training", dynamic_ncols=True,
              disable=run.plain_logs or not run.accelerator.is_main_process) as run.bar, \
            StepProfiler(run.cfg.profile_steps, run.run_dir / "profile", run.accelerator.process_index) as run.profiler:
        while run.progress.step < run.total_steps:
            after_step(run, train_step(run))
    run.train_seconds = time.perf_counter() - start


def train_step(run: Run) -> StepResult:
    """Forward and backward over the step's micro-batches
    (gradient_accumulation_steps of them, or what is left of the epoch), then
    one optimizer step.

    The loss of the step is the sum of the per-target losses over the global
    batch divided by the number of targets in it, not a mean of per-micro-batch
    means (those weigh the targets of short micro-batches more). The targets
    are known from the labels, so their count over all ranks is summed before
    the first forward and every backward carries its exact weight: nothing is
    rescaled afterwards (ZeRO steps inside the last backward)."""
    acc, model, cfg = run.accelerator, run.model, run.cfg
    start = time.perf_counter()
    micro_batches = run.train_batches.take(run.progress.epoch, cfg.gradient_accumulation_steps)
    if not micro_batches:  # an epoch's last micro-batch ends it (after_step), so the next one has some
        raise RuntimeError(f"epoch {run.progress.epoch} has no micro-batch left yet did not end")
    epoch_end = run.train_batches.epoch_ended
    # Sums over all ranks count each batch once per rank that reads it (the tensor-parallel ranks share one).
    readers = tensor_parallel_size(acc)
    data_parallel = acc.num_processes // readers
    source_counts = run.sources.local_counts(micro_batches)
    count, stop_votes, *source_counts = acc.reduce(torch.tensor(
        [sum(run.task.targets(batch) for batch in micro_batches) / readers, run.stop.flag,
         *(c / readers for c in source_counts)], dtype=torch.float64, device=acc.device), reduction="sum").tolist()
    run.sources.add(source_counts)
    # Accelerate (or ZeRO's engine) divides every micro-batch by the accumulation
    # steps and the gradient reduction averages over the data-parallel ranks: undo both.
    weight = cfg.gradient_accumulation_steps * data_parallel / max(count, 1)
    # Accelerate syncs the gradients (and ZeRO steps) when its counter
    # reaches gradient_accumulation_steps: start it so the step's last micro-batch does.
    acc.step = cfg.gradient_accumulation_steps - len(micro_batches)
    metric_names = run.task.step_metrics
    totals = None  # loss sum, units, then each metric's sums (a metric may be a tensor: expert loads) on this rank
    for batch in micro_batches:
        with acc.accumulate(model):
            terms = run.task.loss(model, batch)
            acc.backward(terms.total * weight)
        shapes = [terms.metrics[m].shape for m in metric_names]
        sums = torch.cat([torch.stack([terms.total.detach().float(), terms.units.float().to(terms.total.device)]),
                          *(terms.metrics[m].detach().float().reshape(-1) for m in metric_names)])
        totals = sums if totals is None else totals + sums
    grad_norm = to_float(acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or math.inf))
    lr = run.schedule.lr
    run.optimizer.step()
    run.schedule.step_done()
    run.optimizer.zero_grad(set_to_none=True)
    # One collective: the sums, and each rank's resident memory in its own slot.
    resident = torch.zeros(acc.num_processes, dtype=torch.float64, device=acc.device)
    resident[acc.process_index] = resident_bytes()
    loss_sum, units, *sums = acc.reduce(torch.cat([totals.double() / readers, resident]), reduction="sum").tolist()
    metric_sums, at = {}, 0
    for name, shape in zip(metric_names, shapes):
        size = math.prod(shape)
        metric_sums[name] = sums[at] if not shape else sums[at:at + size]
        at += size
    resident = sums[at:]
    return StepResult(loss_sum / max(count, 1), units, stop_votes, grad_norm, lr, time.perf_counter() - start,
                      epoch_end=epoch_end, resident_bytes_per_rank=[int(b) for b in resident],
                      metrics=run.task.step_means(metric_sums, count))


def after_step(run: Run, result: StepResult) -> None:
    """Everything between two optimizer steps. Raises UsageError on a
    non-finite loss and Stopped (after a checkpoint) when a rank was asked to stop."""
    cfg, progress, loss = run.cfg, run.progress, result.loss
    progress.step += 1
    run.heartbeats.beat()
    if not math.isfinite(loss):
        raise UsageError(non_finite_loss_message(loss, progress.step, run.run_dir, cfg.learning_rate,
                                                 first=run.last_loss is None))
    run.last_loss = loss
    progress.epoch_loss_sum += loss
    progress.epoch_steps += 1
    throughput = result.units / result.seconds
    if progress.step % cfg.log_every == 0 or progress.step == run.total_steps:
        row = {"step": progress.step, "epoch": progress.epoch, "loss": loss, "lr": result.lr,
               "grad_norm": result.grad_norm, "step_time_s": result.seconds, run.task.throughput_key: throughput,
               **result.metrics, **run.sources.log_row(),
               # a scalar per rank, as every tracker plots them
               **{f"rss_bytes_rank{rank}": b for rank, b in enumerate(result.resident_bytes_per_rank)}}
        run.log(row)
        if run.plain_logs:
            say(run.accelerator, step_line(row, run.total_steps, run.task.throughput_key))
    for check in run.no_signal:
        if warning := check.update(progress.step, {"grad_norm": result.grad_norm, **result.metrics}):
            say(run.accelerator, warning)
    run.profiler.step()
    run.bar.update(1)
    run.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{result.lr:.2e}", **{run.task.throughput_key: f"{throughput:,.0f}"})

    if result.epoch_end:
        finish_epoch(run)
    if evaluation_due(cfg, progress, result.epoch_end) and progress.step < run.total_steps:
        run.evaluate()
    run.checkpoints.maybe_save(progress, epoch_end=result.epoch_end)
    if result.stop_votes > 0:
        run.checkpoints.maybe_save(progress, stop=True)
        raise Stopped(f"{run.stop.name()} at step {progress.step}; checkpoint {complete_checkpoints(run.run_dir)[-1]} "
                      f"is complete: continue with `finetune resume {run.run_dir}`", run.stop.received or 15)


def finish_epoch(run: Run) -> None:
    """From here on, `progress.epoch` counts the finished epochs."""
    progress = run.progress
    epoch_loss = progress.epoch_loss_sum / progress.epoch_steps
    progress.epoch += 1
    progress.epoch_loss_sum, progress.epoch_steps = 0.0, 0
    run.train_batches.end_epoch()
    run.log({"step": progress.step, "epoch": progress.epoch, "epoch_loss": epoch_loss})
    run.schedule.epoch_done()


def evaluation_due(cfg: TrainConfig, progress: TrainingProgress, epoch_end: bool) -> bool:
    every_steps = cfg.eval_every and progress.step % cfg.eval_every == 0
    every_epochs = epoch_end and cfg.eval_every_epochs and progress.epoch % cfg.eval_every_epochs == 0
    return bool(every_steps or every_epochs)


SANE_LEARNING_RATE = 1e-3  # the highest a suggestion goes: our from-scratch default, 20x the fine-tuning one


def non_finite_loss_message(loss: float, step: int, run_dir: Path, learning_rate: float, first: bool = False) -> str:
    """The weights after step - 1 produced the bad loss, so a checkpoint of
    that step is not a good one to go back to. `first`: the first step this
    process trained, on the weights it loaded: no update of its own made them."""
    if first:
        return (f"the loss is {loss} at step {step}, the first this run trained, before any update of its own: the "
                "weights it started from or the data give it, not the learning rate; check --model (or the "
                "checkpoint resumed) and the data, and --model_dtype float32 if the model is in half precision")
    good = [c for c in complete_checkpoints(run_dir) if checkpoint_step(c) < step - 1]
    # A tenth of the rate that diverged, but never above the highest rate anyone trains with.
    lower = f"{min(learning_rate / 10, SANE_LEARNING_RATE):g}"
    if not good:
        return (f"the loss is {loss} at step {step}, so the run stopped without saving; no earlier checkpoint "
                f"is usable: start again with a lower --learning_rate (e.g. {lower})")
    return (f"the loss is {loss} at step {step}, so the run stopped without saving; the newest checkpoint whose "
            f"weights still gave a finite loss is {good[-1]}: continue from it with a lower learning rate, e.g. "
            f"`finetune resume {run_dir} "
            f"--resume_from_checkpoint {good[-1]} --learning_rate {lower}`")


def to_float(t: torch.Tensor) -> float:
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


# --- the end --------------------------------------------------------------------------------------

def finish(run: Run) -> dict:
    run.evaluate()
    run.checkpoints.maybe_save(run.progress, end=True)
    rss_before_save = run.host.restart()
    final_dir = write_final_model(run)
    state = run.state or run.backend.state(run.model, stepping_optimizer(run))
    summary = run_summary(run, final_dir, final_save_rss_rise=run.host.peak() - rss_before_save, state=state,
                          trainable=trainable_params(run.model))
    if run.accelerator.is_main_process:
        write_summary(summary, run.run_dir)
        loss_plot = run.run_dir / "loss.png"
        write_model_card(final_dir, run.accelerator.unwrap_model(run.model).config,
                         RunRecord(run.cfg.to_dict(), summary, loss_plot if loss_plot.is_file() else None))
    return summary
