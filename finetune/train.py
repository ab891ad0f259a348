"""The training loop: data -> model -> prepare -> accumulate, clip, step, log,
evaluate, checkpoint -> consolidate the final model. The same loop trains
causal LMs and image classifiers; what differs (data, model, loss, metric)
comes from finetune/tasks.py.

FSDP, mixed precision and process count come from the accelerate config; this
file never branches on them.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import shutil
import time
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.optim.lr_scheduler import LambdaLR, StepLR
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from finetune import models
from finetune.checkpoint import (CheckpointManager, TrainingProgress, checkpoint_step, complete_checkpoints,
                                 resolve_checkpoint)
from finetune.config import TrainConfig
from finetune.distributed import (build_accelerator, count_fsdp_units, gather_ints, peak_memory_bytes,
                                  persistent_state_bytes, slow_bf16_warning, verify_sharded)
from finetune.errors import Stopped, UsageError
from finetune.export import write_model_dir, write_model_files
from finetune.metrics import JSONLTracker, load_metric, plot_loss, summary_markdown, truncate_metrics
from finetune.profiling import StepProfiler
from finetune.stopping import StopSignals
from finetune.tasks import build_task


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuse to mix two runs in one dir. Runs on every rank before the process
    group exists, so no rank can see a file another one just wrote."""
    run_dir = Path(cfg.output_dir)
    if cfg.resume_from_checkpoint or cfg.overwrite:
        return
    if (run_dir / "run_config.yaml").exists() or (run_dir / "checkpoints").exists():
        raise UsageError(f"{run_dir} already holds a run; resume it with `finetune resume {run_dir}`, "
                         "pass --overwrite, or choose another --output_dir")


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with decay on matrices and embeddings only (nanoGPT's rule), or
    the lectures' Adam with L2 decay on every parameter. Both fused: one kernel
    for all parameters instead of about ten ops per parameter, which matters
    most for sharded (DTensor) parameters, where each op is dispatched in Python."""
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.learning_rate, betas=betas,
                                weight_decay=cfg.weight_decay, fused=True)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas, fused=True)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup (the first step already moves), then cosine decay to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    """The cosine schedule is stepped after every optimizer step, the step
    schedule (StepLR, step_size=1) after every epoch; see `schedule_per_epoch`."""
    if cfg.lr_scheduler == "step":
        return StepLR(optimizer, step_size=1, gamma=cfg.lr_gamma)
    warmup = cfg.warmup_steps or max(1, total_steps // 20)
    return LambdaLR(optimizer, lambda step: lr_factor(step, warmup, total_steps, cfg.min_lr_ratio))


def non_finite_loss_message(loss: float, step: int, run_dir: Path, learning_rate: float) -> str:
    """The weights after step - 1 produced the bad loss, so a checkpoint of
    that step is not a good one to go back to."""
    good = [c for c in complete_checkpoints(run_dir) if checkpoint_step(c) < step - 1]
    lower = f"{learning_rate / 10:g}"
    if not good:
        return (f"the loss is {loss} at step {step}, so the run stopped without saving; no earlier checkpoint "
                f"is usable: start again with a lower --learning_rate (e.g. {lower})")
    return (f"the loss is {loss} at step {step}, so the run stopped without saving; the newest checkpoint whose "
            f"weights still gave a finite loss is {good[-1]}: continue from it with a lower learning rate, e.g. "
            f"`finetune resume {run_dir} "
            f"--resume_from_checkpoint {good[-1]} --learning_rate {lower}`")


def rescale_learning_rate(scheduler, learning_rate: float) -> str | None:
    """A checkpoint restores the schedule of the old peak learning rate; a
    resume that passes another --learning_rate scales the whole schedule
    (what is left of it) to the new peak."""
    old = scheduler.base_lrs[0]
    if math.isclose(old, learning_rate, rel_tol=1e-12):
        return None
    ratio = learning_rate / old
    scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]
    scheduler._last_lr = [lr * ratio for lr in scheduler.get_last_lr()]
    for group in scheduler.optimizer.param_groups:
        group["lr"] *= ratio
        group["initial_lr"] *= ratio
    return f"learning rate schedule rescaled from a peak of {old:g} to {learning_rate:g}"


def to_float(t: torch.Tensor) -> float:
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def build_trackers(cfg: TrainConfig) -> list:
    """Accelerate trackers for --report_to: metrics.jsonl, TensorBoard, or none."""
    wanted = set(cfg.report_to.split(","))
    trackers: list = []
    if "jsonl" in wanted:
        trackers.append(JSONLTracker(Path(cfg.output_dir) / "metrics.jsonl"))
    if "tensorboard" in wanted:
        if not (importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")):
            raise UsageError("--report_to tensorboard needs the tensorboard package; pip install tensorboard, "
                             "or drop tensorboard from --report_to")
        trackers.append("tensorboard")
    return trackers


def train(cfg: TrainConfig) -> dict:
    check_run_dir(cfg)
    models.check_task(cfg.model, cfg.task)
    run_dir = Path(cfg.output_dir)
    fresh_run_dir = not run_dir.exists()
    accelerator = build_accelerator(cfg.gradient_accumulation_steps, cfg.seed, build_trackers(cfg), run_dir)
    try:
        with StopSignals() as stop:
            return _train(cfg, accelerator, stop)
    except UsageError:
        # Bad input found before the run started writing (run_config.yaml comes
        # first) leaves no half-made run dir behind.
        if fresh_run_dir and accelerator.is_main_process and not (run_dir / "run_config.yaml").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        # Free the wrapped model while the process group is alive: a DDP reducer
        # destroyed after its gloo group hangs in the group's destructor.
        accelerator.free_memory()
        gc.collect()
        accelerator.end_training()


def _train(cfg: TrainConfig, accelerator: Accelerator, stop: StopSignals) -> dict:
    main = accelerator.is_main_process
    if warning := slow_bf16_warning(accelerator):
        accelerator.print(warning)
    run_dir = Path(cfg.output_dir)
    config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    resume_from = resolve_checkpoint(run_dir, cfg.resume_from_checkpoint) if cfg.resume_from_checkpoint else None

    task = build_task(cfg)
    data = task.build(accelerator, run_dir)
    global_batch = cfg.per_device_batch_size * accelerator.num_processes
    if len(data.train) < global_batch:
        raise UsageError(f"{len(data.train)} training samples are fewer than one batch on every rank "
                         f"({cfg.per_device_batch_size} x {accelerator.num_processes}); add data or lower "
                         f"{task.batch_size_options}")
    model = data.model
    train_loader = DataLoader(data.train, batch_size=cfg.per_device_batch_size, shuffle=True, drop_last=True)
    eval_loader = DataLoader(data.validation, batch_size=cfg.per_device_batch_size)

    train_loader, eval_loader = accelerator.prepare(train_loader, eval_loader)  # now per rank

    # The last micro-batches of an epoch make a step even when fewer than
    # gradient_accumulation_steps are left.
    steps_per_epoch = math.ceil(len(train_loader) / cfg.gradient_accumulation_steps)
    total_steps = cfg.max_steps or cfg.num_epochs * steps_per_epoch
    schedule_per_epoch = cfg.lr_scheduler == "step"
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    shards = verify_sharded(model, accelerator)
    fsdp_units = count_fsdp_units(model)
    metric = load_metric(task.metric_name, accelerator)

    hf_config = accelerator.unwrap_model(model).config
    checkpoints = CheckpointManager(accelerator, run_dir, cfg.checkpoint_every, cfg.checkpoint_every_epochs,
                                    cfg.keep_last, lambda target: write_model_files(target, hf_config, data.tokenizer))

    def log(row: dict) -> None:
        accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    progress = TrainingProgress(world_size=accelerator.num_processes)
    if resume_from:
        progress = checkpoints.load(resume_from, model, cfg.seed)
        if main:  # rows logged after that checkpoint belong to the lost part of the run
            truncate_metrics(run_dir / "metrics.jsonl", progress.step)
        accelerator.print(f"resumed from {resume_from} at step {progress.step}")
        if change := rescale_learning_rate(scheduler.scheduler, cfg.learning_rate):
            accelerator.print(change)
    # Everything is checked: from here on the run writes into its dir.
    if main:
        (run_dir / "run_config.yaml").write_text(config_yaml)
        if not resume_from:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    accelerator.init_trackers("tensorboard", config=cfg.to_dict())
    accelerator.print(f"{accelerator.distributed_type.value} on {accelerator.num_processes} process(es), "
                      f"{shards.total_params:,} parameters in {fsdp_units} FSDP unit(s), per rank "
                      f"{shards.local_params_per_rank}; {data.description}; {total_steps} steps")

    evals = []

    def run_eval() -> dict:
        result = task.evaluate(model, eval_loader, accelerator, metric)
        progress.best_eval_loss = min(progress.best_eval_loss, result["eval_loss"])
        log({"step": progress.step, "epoch": progress.epoch, **result})
        evals.append((progress.step, result))
        return result

    if not resume_from:
        run_eval()

    # The loop.
    model.train()
    samples_per_step = global_batch * cfg.gradient_accumulation_steps
    throughput_per_step = samples_per_step * task.units_per_sample()
    with tqdm(total=total_steps, initial=progress.step, disable=not main, desc="training", dynamic_ncols=True) as bar, \
            StepProfiler(cfg.profile_steps, run_dir / "profile", accelerator.process_index) as profiler:
        start = time.perf_counter()
        step_start = start
        window_loss, window_batches = torch.zeros((), device=accelerator.device), 0
        loss = None  # stays None when a resume has no step left to run
        state_bytes = None  # measured once, after the first optimizer step
        while progress.step < total_steps:
            # Non-zero only right after a resume; rounds down when the world size changed.
            skip = progress.samples_in_epoch // global_batch
            progress.samples_in_epoch = skip * global_batch
            batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
            batches.set_epoch(progress.epoch)  # the order of an epoch depends on (seed, epoch) only
            for batch in batches:
                with accelerator.accumulate(model):
                    loss_t = task.loss(model, batch)
                    accelerator.backward(loss_t)
                    window_loss += loss_t.detach()
                    window_batches += 1
                    if accelerator.sync_gradients:
                        grad_norm = to_float(accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or math.inf))
                        lr = scheduler.get_last_lr()[0]
                        optimizer.step()
                        if state_bytes is None:
                            state_bytes = persistent_state_bytes(model, optimizer)
                        if not schedule_per_epoch:
                            scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
                progress.samples_in_epoch += global_batch
                if not accelerator.sync_gradients:
                    continue

                # One optimizer step done.
                progress.step += 1
                # One collective for the loss and for "a rank was asked to stop".
                shared = accelerator.reduce(torch.stack([window_loss / window_batches,
                                                         torch.tensor(stop.flag, device=accelerator.device)]),
                                            reduction="mean").tolist()
                loss, stop_requested = shared[0], shared[1] > 0
                window_loss.zero_()
                window_batches = 0
                now = time.perf_counter()
                step_time, step_start = now - step_start, now
                if not math.isfinite(loss):
                    raise UsageError(non_finite_loss_message(loss, progress.step, run_dir, cfg.learning_rate))
                progress.epoch_loss_sum += loss
                progress.epoch_steps += 1
                if progress.step % cfg.log_every == 0 or progress.step == total_steps:
                    log({"step": progress.step, "epoch": progress.epoch, "loss": loss, "lr": lr,
                               "grad_norm": grad_norm, "step_time_s": step_time,
                               task.throughput_key: throughput_per_step / step_time})
                profiler.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}",
                                **{task.throughput_key: f"{throughput_per_step / step_time:,.0f}"})

                epoch_end = accelerator.gradient_state.end_of_dataloader
                if epoch_end:  # from here on, `epoch` counts the finished epochs
                    epoch_loss = progress.epoch_loss_sum / progress.epoch_steps
                    progress.epoch += 1
                    progress.samples_in_epoch, progress.epoch_loss_sum, progress.epoch_steps = 0, 0.0, 0
                    log({"step": progress.step, "epoch": progress.epoch, "epoch_loss": epoch_loss})
                    if schedule_per_epoch:
                        scheduler.step()
                eval_due = (cfg.eval_every and progress.step % cfg.eval_every == 0) or \
                    (epoch_end and cfg.eval_every_epochs and progress.epoch % cfg.eval_every_epochs == 0)
                if eval_due and progress.step < total_steps:
                    run_eval()
                checkpoints.maybe_save(progress, config_yaml, epoch_end=epoch_end)
                if stop_requested:
                    checkpoints.maybe_save(progress, config_yaml, final=True)
                    raise Stopped(f"{stop.name()} at step {progress.step}; checkpoint {complete_checkpoints(run_dir)[-1]} "
                                  f"is complete: continue with `finetune resume {run_dir}`", stop.received or 15)
                step_start = time.perf_counter()  # eval and checkpoint time is not step time
                if progress.step >= total_steps:
                    break
    train_time = time.perf_counter() - start

    run_eval()
    checkpoints.maybe_save(progress, config_yaml, final=True)

    # Consolidate the full state on rank 0 and write the HF model dir.
    state_dict = accelerator.get_state_dict(model)
    # Under `accelerate launch --dynamo_backend ...` the unwrapped model is still
    # the torch.compile wrapper, whose keys carry its prefix.
    state_dict = {name.removeprefix("_orig_mod."): tensor for name, tensor in state_dict.items()}
    final_dir = run_dir / "final"
    if main:
        write_model_dir(state_dict, hf_config, final_dir, tokenizer=data.tokenizer, overwrite=True)
    accelerator.wait_for_everyone()

    is_fsdp = accelerator.distributed_type == DistributedType.FSDP
    summary = {
        "task": cfg.task,
        "model": cfg.model,
        "world_size": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "fsdp_version": accelerator.state.fsdp_plugin.fsdp_version if is_fsdp else None,
        "mixed_precision": accelerator.mixed_precision,
        "total_params": shards.total_params,
        "fsdp_units": fsdp_units,
        "local_params_per_rank": shards.local_params_per_rank,
        "peak_memory_bytes_per_rank": gather_ints(accelerator, peak_memory_bytes(accelerator)),
        "state_bytes_per_rank": gather_ints(accelerator, sum(state_bytes.values()) if state_bytes else 0),
        "train_time_s": train_time,
        "steps": progress.step,
        "final_loss": loss,
        "first_eval": evals[0][1] if evals[0][0] == 0 else None,
        "last_eval": evals[-1][1],
        "final_model_dir": str(final_dir),
    }
    if main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (run_dir / "summary.md").write_text(summary_markdown(summary, run_dir))
        if (run_dir / "metrics.jsonl").is_file():
            plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    return summary
