"""Evaluation (perplexity and accuracy through `evaluate` modules shipped with
the package), the metrics.jsonl log, and the loss plot."""

from __future__ import annotations

import json
from pathlib import Path

import evaluate
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

MODULES_DIR = Path(__file__).parent / "metrics_modules"


def load_metric(name: str, accelerator: Accelerator) -> evaluate.EvaluationModule:
    # evaluate copies the module into its cache on load: one rank at a time.
    with accelerator.main_process_first():
        return evaluate.load(str(MODULES_DIR / name), keep_in_memory=True)


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """Targets for every position: the next token, ignored (-100) at the last.
    Shifting the targets instead of the logits spares a copy of the [B, T,
    vocab] logits, the largest tensor of the step."""
    return F.pad(input_ids[:, 1:], (0, 1), value=-100)


def next_token_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token NLL [B, T-1] of predicting input_ids[:, t+1] from position t,
    in fp32 whatever the compute dtype (bf16 logits would quantise the loss)."""
    targets = next_token_targets(input_ids)
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    return nll.view(targets.shape)[:, :-1]


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean of next_token_nll, reduced inside cross_entropy."""
    return F.cross_entropy(logits.float().flatten(0, 1), next_token_targets(input_ids).flatten(), ignore_index=-100)


def sequence_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence summed next-token NLL and token counts."""
    nll = next_token_nll(logits, input_ids)
    return nll.sum(dim=1), torch.full((nll.size(0),), nll.size(1), dtype=torch.long, device=nll.device)


@torch.no_grad()
def evaluate_perplexity(model, dataloader, accelerator: Accelerator, metric: evaluate.EvaluationModule,
                        max_batches: int = 0) -> dict[str, float]:
    """Every rank runs the same number of batches (FSDP forwards are collective);
    `gather_for_metrics` drops the samples the distributed sampler repeated."""
    was_training = model.training
    model.eval()
    for i, batch in enumerate(dataloader):
        if max_batches and i >= max_batches:
            break
        nll, counts = sequence_nll(model(input_ids=batch["input_ids"], use_cache=False).logits, batch["input_ids"])
        nll, counts = accelerator.gather_for_metrics((nll, counts))
        metric.add_batch(nll_sum=nll.double().cpu().tolist(), num_tokens=counts.cpu().tolist())
    model.train(was_training)
    return metric.compute()


@torch.no_grad()
def evaluate_accuracy(model, dataloader, accelerator: Accelerator, metric: evaluate.EvaluationModule,
                      inputs, max_batches: int = 0) -> dict[str, float]:
    """Accuracy and mean cross-entropy over all ranks. `gather_for_metrics`
    drops the samples the distributed sampler repeated to even out the ranks,
    so every sample counts once. `inputs(batch)` gives the model's input."""
    was_training = model.training
    model.eval()
    nll_sum, count = 0.0, 0
    for i, batch in enumerate(dataloader):
        if max_batches and i >= max_batches:
            break
        logits = model(inputs(batch)).logits.float()
        nll = F.cross_entropy(logits, batch["label"], reduction="none")
        predictions, references, nll = accelerator.gather_for_metrics((logits.argmax(dim=-1), batch["label"], nll))
        metric.add_batch(predictions=predictions.cpu().tolist(), references=references.cpu().tolist())
        nll_sum += float(nll.double().sum())
        count += nll.numel()
    model.train(was_training)
    result = metric.compute()
    return {"eval_loss": nll_sum / count, "accuracy": result["accuracy"], "num_samples": result["num_samples"]}


class JSONLTracker(GeneralTracker):
    """metrics.jsonl as an Accelerate tracker: `accelerator.log(values, step)`
    appends {"step": step, **values}, on the main process only."""

    name = "jsonl"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, path: Path):
        super().__init__()
        self.path = Path(path)

    @property
    def tracker(self) -> Path:
        return self.path

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the rows after `step` (they belong to the part of a run a resume repeats)."""
    if path.is_file():
        kept = [row for row in read_metrics(path) if row["step"] <= step]
        path.write_text("".join(json.dumps(row) + "\n" for row in kept))


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(metrics_path: Path, out_path: Path) -> None:
    """Train loss per step and validation loss per evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def summary_markdown(summary: dict, run_dir: Path) -> str:
    """summary.md: the facts of summary.json for a person."""
    first, last = summary["first_eval"], summary["last_eval"]
    metric = "perplexity" if "perplexity" in last else "accuracy"
    mib = [f"{b / 2**20:,.0f}" for b in summary["peak_memory_bytes_per_rank"]]
    lines = [
        f"# {summary['task']} run: {summary['model']}",
        "",
        f"- Sharding: {summary['distributed_type']} on {summary['world_size']} process(es)"
        + (f", FSDP{summary['fsdp_version']} with {summary['fsdp_units']} units" if summary["fsdp_version"] else ""),
        f"- Parameters: {summary['total_params']:,} in all; per rank {', '.join(f'{n:,}' for n in summary['local_params_per_rank'])}",
        f"- Mixed precision: {summary['mixed_precision']}",
        f"- Steps: {summary['steps']} in {summary['train_time_s']:.1f} s; final train loss "
        + (f"{summary['final_loss']:.4f}" if summary["final_loss"] is not None else "n/a"),
        f"- Validation {metric}: " + (f"{first[metric]:.4f} -> " if first else "") + f"{last[metric]:.4f}"
        + f" (loss {last['eval_loss']:.4f})",
        f"- Peak memory per rank: {', '.join(mib)} MiB",
        f"- Final model: `{summary['final_model_dir']}`",
        "",
        f"Resume or extend: `accelerate launch --config_file ... -m finetune resume {run_dir} --max_steps N`.  ",
        f"Export a checkpoint: `finetune export {run_dir} --output DIR`.  ",
        "Curves: `loss.png`; every row: `metrics.jsonl`; all facts: `summary.json`.",
    ]
    return "\n".join(lines) + "\n"
