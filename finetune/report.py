"""What a run reports: metrics through Accelerate's trackers (metrics.jsonl,
TensorBoard), the loss plot, and summary.json / summary.md at the end."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from accelerate.tracking import GeneralTracker

from finetune.errors import UsageError

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


def build_trackers(report_to: str, run_dir: Path) -> list:
    """Accelerate trackers for --report_to: metrics.jsonl, TensorBoard, or none."""
    wanted = set(report_to.split(","))
    trackers: list = []
    if "jsonl" in wanted:
        trackers.append(JSONLTracker(run_dir / "metrics.jsonl"))
    if "tensorboard" in wanted:
        if not (importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")):
            raise UsageError("--report_to tensorboard needs the tensorboard package; pip install tensorboard, "
                             "or drop tensorboard from --report_to")
        trackers.append("tensorboard")
    return trackers


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
        f"- V{eval_line(summary)[1:]} (loss {summary['last_eval']['eval_loss']:.4f})",
        f"- Peak memory per rank: {', '.join(mib)} MiB",
        f"- Final model: `{summary['final_model_dir']}`",
        "",
        f"Resume or extend: `accelerate launch --config_file ... -m finetune resume {run_dir} --max_steps N`.  ",
        f"Export a checkpoint: `finetune export {run_dir} --output DIR`.  ",
        "Curves: `loss.png`; every row: `metrics.jsonl`; all facts: `summary.json`.",
    ]
    return "\n".join(lines) + "\n"


def write_summary(summary: dict, run_dir: Path) -> None:
    """summary.json, summary.md, and loss.png when there are metrics to plot."""
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "summary.md").write_text(summary_markdown(summary, run_dir))
    if (run_dir / "metrics.jsonl").is_file():
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")


def eval_line(summary: dict) -> str:
    """The console's line for the run's score: first -> last evaluation."""
    first, last, metric = summary["first_eval"], summary["last_eval"], summary["metric"]
    score = (f"{first[metric]:.4f} -> " if first else "") + f"{last[metric]:.4f}"
    loss = (f"{first['eval_loss']:.4f} -> " if first else "") + f"{last['eval_loss']:.4f}"
    return f"validation {metric}: {score} (loss {loss})"
