"""The training loop for causal LMs: data -> model -> prepare -> accumulate,
clip, step, log, evaluate, checkpoint -> consolidate the final model.

FSDP, mixed precision and process count come from the accelerate config; this
file never branches on them.
"""

from __future__ import annotations

import gc
import json
import math
import time
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoTokenizer, GenerationConfig

from finetune import models
from finetune.checkpoint import CheckpointManager, TrainingProgress, resolve_checkpoint
from finetune.config import TrainConfig
from finetune.data.text import load_raw_text, text_iterator, tokenize_and_group
from finetune.data.tokenizer import train_bpe_tokenizer
from finetune.distributed import (build_accelerator, gather_ints, peak_memory_bytes, persistent_state_bytes,
                                  slow_bf16_warning, verify_sharded)
from finetune.errors import UsageError
from finetune.export import write_model_dir
from finetune.metrics import MetricsLog, evaluate_perplexity, load_metric, next_token_nll, plot_loss


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuse to mix two runs in one dir. Runs on every rank before the process
    group exists, so no rank can see a file another one just wrote."""
    run_dir = Path(cfg.output_dir)
    if cfg.resume_from_checkpoint or cfg.overwrite:
        return
    if (run_dir / "run_config.yaml").exists() or (run_dir / "checkpoints").exists():
        raise UsageError(f"{run_dir} already holds a run; resume it with `finetune resume {run_dir}`, "
                         "pass --overwrite, or choose another --output_dir")


def build_tokenizer_and_model(cfg: TrainConfig, raw_train, accelerator, run_dir: Path):
    """A preset trains its own tokenizer on the training text (once, on the main
    process, saved with the run); anything else brings its tokenizer."""
    if models.is_preset(cfg.model):
        tokenizer_dir = run_dir / "tokenizer"
        if accelerator.is_main_process and not (tokenizer_dir / "tokenizer.json").is_file():
            tok = train_bpe_tokenizer(text_iterator(raw_train), models.preset_vocab_size(cfg.model))
            tok.save_pretrained(tokenizer_dir)
        accelerator.wait_for_everyone()
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        set_seed(cfg.seed)  # every rank initialises the same weights before sharding
        model = models.build_preset(cfg.model, tokenizer.bos_token_id, tokenizer.eos_token_id)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as e:
            raise UsageError(f"--model {cfg.model} has no usable tokenizer ({str(e).splitlines()[0]}); "
                             "save one next to the model with tokenizer.save_pretrained") from None
        model = models.load_pretrained(cfg.model, cfg.trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise UsageError(f"the tokenizer of --model {cfg.model} has no end-of-text token; set eos_token and save it again")
    if len(tokenizer) > model.config.vocab_size:
        raise UsageError(f"the tokenizer has {len(tokenizer)} tokens but --model {cfg.model} only {model.config.vocab_size}; "
                         "use the tokenizer the model was trained with")
    if cfg.block_size > model.config.max_position_embeddings:
        raise UsageError(f"--block_size {cfg.block_size} is longer than the model's {model.config.max_position_embeddings} "
                         "positions; lower --block_size")
    return tokenizer, model


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and embeddings only (nanoGPT's rule)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2))


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup (the first step already moves), then cosine decay to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def to_float(t: torch.Tensor) -> float:
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def train(cfg: TrainConfig) -> dict:
    check_run_dir(cfg)
    accelerator = build_accelerator(cfg.gradient_accumulation_steps, cfg.seed)
    summary = _train(cfg, accelerator)
    # Free the wrapped model while the process group is alive: a DDP reducer
    # destroyed after its gloo group hangs in the group's destructor.
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()
    return summary


def _train(cfg: TrainConfig, accelerator: Accelerator) -> dict:
    main = accelerator.is_main_process
    if warning := slow_bf16_warning(accelerator):
        accelerator.print(warning)
    run_dir = Path(cfg.output_dir)
    config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    resume_from = resolve_checkpoint(run_dir, cfg.resume_from_checkpoint) if cfg.resume_from_checkpoint else None

    # Data and model, checked before the run writes anything but its tokenizer.
    # The main process goes first and fills the datasets cache.
    with accelerator.main_process_first():
        raw = load_raw_text(cfg.dataset, cfg.text_column, cfg.validation_split, cfg.seed)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, model = build_tokenizer_and_model(cfg, raw["train"], accelerator, run_dir)
    with accelerator.main_process_first():
        blocks = tokenize_and_group(raw, tokenizer, cfg.block_size)
    global_batch = cfg.per_device_batch_size * accelerator.num_processes
    if len(blocks["train"]) < global_batch:
        raise UsageError(f"{len(blocks['train'])} training blocks are fewer than one batch on every rank "
                         f"({cfg.per_device_batch_size} x {accelerator.num_processes}); add text or lower "
                         "--per_device_batch_size/--block_size")
    if main:
        (run_dir / "run_config.yaml").write_text(config_yaml)
        if not resume_from:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    train_loader = DataLoader(blocks["train"], batch_size=cfg.per_device_batch_size, shuffle=True, drop_last=True)
    eval_loader = DataLoader(blocks["validation"], batch_size=cfg.per_device_batch_size)

    steps_per_epoch = math.ceil(len(train_loader) / accelerator.num_processes / cfg.gradient_accumulation_steps)
    total_steps = cfg.max_steps or cfg.num_epochs * steps_per_epoch
    warmup = cfg.warmup_steps or max(1, total_steps // 20)
    optimizer = build_optimizer(model, cfg)
    scheduler = LambdaLR(optimizer, lambda step: lr_factor(step, warmup, total_steps, cfg.min_lr_ratio))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    shards = verify_sharded(model, accelerator)
    metric = load_metric("perplexity", accelerator)

    hf_config = accelerator.unwrap_model(model).config

    def write_model_files(target: Path) -> None:
        hf_config.save_pretrained(target)
        GenerationConfig.from_model_config(hf_config).save_pretrained(target)
        tokenizer.save_pretrained(target)

    checkpoints = CheckpointManager(accelerator, run_dir, cfg.checkpoint_every, cfg.keep_last, write_model_files)
    log = MetricsLog(run_dir / "metrics.jsonl", main)
    progress = TrainingProgress(world_size=accelerator.num_processes)
    if resume_from:
        progress = checkpoints.load(resume_from, model, cfg.seed)
        if main:  # rows logged after that checkpoint belong to the lost part of the run
            log.truncate_after(progress.step)
        accelerator.print(f"resumed from {resume_from} at step {progress.step}")
    accelerator.print(f"{accelerator.distributed_type.value} on {accelerator.num_processes} process(es), "
                      f"{shards.total_params:,} parameters, per rank {shards.local_params_per_rank}; "
                      f"{len(blocks['train'])} train / {len(blocks['validation'])} validation blocks of {cfg.block_size}; "
                      f"{total_steps} steps")

    def run_eval() -> dict:
        result = evaluate_perplexity(model, eval_loader, accelerator, metric, cfg.max_eval_batches)
        progress.best_eval_loss = min(progress.best_eval_loss, result["eval_loss"])
        log.write({"step": progress.step, **result})
        return result

    first_eval = run_eval() if not resume_from else None

    # The loop.
    model.train()
    tokens_per_step = global_batch * cfg.gradient_accumulation_steps * cfg.block_size
    bar = tqdm(total=total_steps, initial=progress.step, disable=not main, desc="training", dynamic_ncols=True)
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
                loss_t = next_token_nll(model(input_ids=batch["input_ids"]).logits, batch["input_ids"]).mean()
                accelerator.backward(loss_t)
                window_loss += loss_t.detach()
                window_batches += 1
                if accelerator.sync_gradients:
                    grad_norm = to_float(accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or math.inf))
                    lr = scheduler.get_last_lr()[0]
                    optimizer.step()
                    if state_bytes is None:
                        state_bytes = persistent_state_bytes(model, optimizer)
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
            progress.samples_in_epoch += global_batch
            if not accelerator.sync_gradients:
                continue

            progress.step += 1
            loss = accelerator.reduce(window_loss / window_batches, reduction="mean").item()
            window_loss.zero_()
            window_batches = 0
            now = time.perf_counter()
            step_time, step_start = now - step_start, now
            if not math.isfinite(loss):
                raise RuntimeError(f"loss is {loss} at step {progress.step}; lower --learning_rate "
                                   "(the last complete checkpoint is kept)")
            if progress.step % cfg.log_every == 0 or progress.step == total_steps:
                log.write({"step": progress.step, "epoch": progress.epoch, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                           "step_time_s": step_time, "tokens_per_sec": tokens_per_step / step_time})
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_step / step_time:,.0f}")
            if cfg.eval_every and progress.step % cfg.eval_every == 0 and progress.step < total_steps:
                run_eval()
            checkpoints.maybe_save(progress, config_yaml)
            step_start = time.perf_counter()  # eval and checkpoint time is not step time
            if progress.step >= total_steps:
                break
        else:
            progress.epoch += 1
            progress.samples_in_epoch = 0
    bar.close()
    train_time = time.perf_counter() - start

    last_eval = run_eval()
    checkpoints.maybe_save(progress, config_yaml, final=True)

    # Consolidate the full state on rank 0 and write the HF model dir.
    state_dict = accelerator.get_state_dict(model)
    final_dir = run_dir / "final"
    if main:
        write_model_dir(state_dict, hf_config, final_dir, tokenizer=tokenizer, overwrite=True)
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
        "local_params_per_rank": shards.local_params_per_rank,
        "peak_memory_bytes_per_rank": gather_ints(accelerator, peak_memory_bytes(accelerator)),
        "state_bytes_per_rank": gather_ints(accelerator, sum(state_bytes.values()) if state_bytes else 0),
        "train_time_s": train_time,
        "steps": progress.step,
        "final_loss": loss,
        "first_eval": first_eval,
        "last_eval": last_eval,
        "final_model_dir": str(final_dir),
    }
    if main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    return summary
