"""What a run reports: metrics through Accelerate's trackers (metrics.jsonl,
TensorBoard, Weights & Biases, MLflow), the loss plot, and summary.json /
summary.md at the end.

Trackers get grouped names (`train/loss`, `eval/perplexity`); metrics.jsonl
keeps the flat ones of its contract (`loss`, `eval_loss`, `perplexity`)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

from accelerate import PartialState
from accelerate.tracking import GeneralTracker, MLflowTracker, TensorBoardTracker, WandBTracker
from tqdm.auto import tqdm

from finetune.collectives import gather_ints
from finetune.errors import UsageError
from finetune.hardware import device_name
from finetune.host_memory import peak_memory_bytes
from finetune import json_text

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
            f.write(json_text.dumps({"step": step, **flat_names(values)}) + "\n")


def grouped_names(row: dict) -> dict:
    """A metrics row (without its step) under the trackers' grouped names."""
    group = "eval" if "eval_loss" in row else "train"
    return {f"{group}/{key.removeprefix('eval_') if group == 'eval' else key}": value
            for key, value in row.items() if key != "step"}


def flat_names(values: dict) -> dict:
    """The inverse of grouped_names."""
    flat = {}
    for key, value in values.items():
        group, _, name = key.partition("/")
        # eval rows keep eval_ on TRL's slashed names (eval_rewards/chosen), as on eval_loss
        flat[f"eval_{name}" if group == "eval" and (name == "loss" or "/" in name) else name or key] = value
    return flat


# Where a run keeps the ids of its tracker runs, so that a resume continues them.
TRACKER_RUNS = "tracker_runs.json"


class TrackerRuns:
    """The W&B / MLflow run ids of a training run: new for a new run, the
    recorded ones for a resume. Read and written on the main process when the
    trackers start (after every check has passed)."""

    def __init__(self, run_dir: Path, resume: bool):
        self.path, self.resume = run_dir / TRACKER_RUNS, resume

    def get(self, tracker: str) -> str | None:
        if not self.resume or not self.path.is_file():
            return None
        return json.loads(self.path.read_text()).get(tracker)

    def record(self, tracker: str, run_id: str) -> None:
        ids = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.path.write_text(json.dumps({**ids, tracker: run_id}) + "\n")


class RunWandB(WandBTracker):
    """One W&B run per training run, named after the run dir; a resume continues it."""

    def __init__(self, run_dir: Path, runs: TrackerRuns):
        super().__init__("finetune", name=run_dir.name, dir=str(run_dir), resume="allow")
        self.runs = runs

    def start(self):
        if PartialState().is_main_process:
            self.init_kwargs["id"] = self.runs.get("wandb") or uuid.uuid4().hex[:16]
            self.runs.record("wandb", self.init_kwargs["id"])
        super().start()

    def finish(self):
        if getattr(self, "run", None) is not None:  # not when the start failed
            super().finish()


class RunMLflow(MLflowTracker):
    """One MLflow run per training run (experiment "finetune", run name = the
    run dir's name; MLFLOW_TRACKING_URI says where); a resume continues it."""

    def __init__(self, run_dir: Path, runs: TrackerRuns):
        super().__init__(experiment_name="finetune", run_name=run_dir.name)
        self.runs = runs

    def start(self):
        if PartialState().is_main_process:
            self.run_id = self.runs.get("mlflow")
            super().start()
            self.runs.record("mlflow", self.active_run.info.run_id)

    def store_init_configuration(self, values: dict):
        # MLflow refuses to change a logged parameter, and a resume may change some (max_steps, ...):
        # the parameters stay those the run started with.
        if self.run_id is None:
            super().store_init_configuration(values)


TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "mlflow": ("mlflow", "mlflow-skinny")}


def build_trackers(report_to: str, run_dir: Path, resume: bool) -> list:
    """Accelerate trackers for --report_to: metrics.jsonl, TensorBoard, W&B, MLflow, or none."""
    wanted = set(report_to.split(","))
    for name in sorted(wanted & set(TRACKER_PACKAGES)):
        module, package = TRACKER_PACKAGES[name]
        if not importlib.util.find_spec(module):
            raise UsageError(f"--report_to {name} needs the {package} package; pip install 'finetune[{name}]', "
                             f"or drop {name} from --report_to")
    runs = TrackerRuns(run_dir, resume)
    trackers: list = []
    if "jsonl" in wanted:
        trackers.append(JSONLTracker(run_dir / "metrics.jsonl"))
    if "tensorboard" in wanted:
        trackers.append(TensorBoardTracker("tensorboard", run_dir))
    if "wandb" in wanted:
        trackers.append(RunWandB(run_dir, runs))
    if "mlflow" in wanted:
        trackers.append(RunMLflow(run_dir, runs))
    return trackers


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the rows after `step` (they belong to the part of a run a resume repeats)."""
    if path.is_file():
        kept = [row for row in read_metrics(path) if row["step"] <= step]
        path.write_text("".join(json_text.dumps(row) + "\n" for row in kept))


def read_evaluations(path: Path) -> list[tuple[int, dict]]:
    """(step, result) of the evaluations metrics.jsonl holds."""
    return [(row["step"], {k: v for k, v in row.items() if k not in ("step", "epoch")})
            for row in read_metrics(path) if "eval_loss" in row]


def read_metrics(path: Path) -> list[dict]:
    return [row for row in json_text.read_jsonl(path) if isinstance(row.get("step"), int)]


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
        f"- V{eval_line(summary)[1:]}",  # the line names the loss too
        f"- Peak memory per rank: {', '.join(mib)} MiB",
        f"- Final model: `{summary['final_model_dir']}`",
        "",
        f"Extend: `finetune resume {run_dir} --max_steps N` (relaunched as run_config.yaml's `launch:` records).  ",
        f"Export a checkpoint: `finetune export {run_dir} --output DIR`.  ",
        "Curves: `loss.png`; every row: `metrics.jsonl`; all facts: `summary.json`.",
    ]
    return "\n".join(lines) + "\n"


def write_summary(summary: dict, run_dir: Path) -> None:
    """summary.json, summary.md, and loss.png when there are metrics to plot."""
    (run_dir / "summary.json").write_text(json_text.dumps(summary, indent=2))
    (run_dir / "summary.md").write_text(summary_markdown(summary, run_dir))
    if (run_dir / "metrics.jsonl").is_file():
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")


def plain_logs(log_format: str) -> bool:
    """Plain lines instead of a progress bar: asked for, or no terminal to
    redraw a bar on (a CI log, a file), or bars disabled with TQDM_DISABLE."""
    if log_format != "auto":
        return log_format == "plain"
    return not sys.stdout.isatty() or os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes")


def quiet_library_bars() -> None:
    """datasets', transformers' and the Hub's progress bars (a redrawn line each)."""
    import datasets
    import huggingface_hub
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


def say(accelerator, message: str) -> None:
    """A line of its own on the main process, never glued to a progress bar."""
    if accelerator.is_main_process:
        tqdm.write(message)
        sys.stdout.flush()


def rank_warning(accelerator, message: str) -> None:
    """A warning that holds for this rank only."""
    print(f"[rank {accelerator.process_index}] warning: {message}", file=sys.stderr, flush=True)


def console_width() -> int | None:
    """The terminal's width (COLUMNS first); None when the output is a file or a pipe (no width to keep to)."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def step_line(row: dict, total_steps: int, throughput_key: str, width: int | None = None) -> str:
    """One line per logged step, within the console's `width`: an objective's
    or a mixture's own metrics as many as fit, in their order, the rest
    counted (metrics.jsonl has them all). Written to a file or a pipe, all of them."""
    width = width or console_width() or 1 << 30
    unit = throughput_key.removesuffix("_per_sec")
    line = (f"step {row['step']}/{total_steps}  loss {row['loss']:.4f}  lr {row['lr']:.3e}  "
            f"grad_norm {row['grad_norm']:.3f}  {unit}/s {row[throughput_key]:,.0f}")
    # an objective's own (rewards/..., reward, kl) and a mixture's tokens per source (tokens/...)
    shown = {"step", "epoch", "loss", "lr", "grad_norm", "step_time_s", throughput_key}
    extras = [f"  {name} {row[name]:,}" if isinstance(row[name], int) else f"  {name} {row[name]:.4f}"
              for name in row if name not in shown and not name.startswith(("rss_bytes_rank", "expert_load/"))]
    for i, extra in enumerate(extras):
        rest = f"  (+{len(extras) - i - 1} more)" if i < len(extras) - 1 else ""
        if len(line) + len(extra) + len(rest) > width:
            return line + f"  (+{len(extras) - i} more)"
        line += extra
    return line


def evaluation_line(step: int, result: dict, metric: str) -> str:
    return f"eval at step {step}: loss {result['eval_loss']:.4f}, {metric} {result[metric]:.4f}"


def eval_line(summary: dict) -> str:
    """The console's line for the run's score: first -> last evaluation."""
    first, last, metric = summary["first_eval"], summary["last_eval"], summary["metric"]
    score = (f"{first[metric]:.4f} -> " if first else "") + f"{last[metric]:.4f}"
    loss = (f"{first['eval_loss']:.4f} -> " if first else "") + f"{last['eval_loss']:.4f}"
    return f"validation {metric}: {score} (loss {loss})"


def run_summary(run, final_dir: Path, final_save_rss_rise: int, state: dict[str, dict[str, int]],
                trainable: int) -> dict:
    """summary.json's keys (see the interface's run layout) for a finetune.train.Run
    at its end; `state` is what each rank holds (the backend's accounting). A
    collective: every rank calls it."""
    acc = run.accelerator
    return {
        "task": run.cfg.task,
        "model": run.cfg.model,
        "data_format": run.data.data_format,
        "world_size": acc.num_processes,
        "device_name": device_name(acc.device),  # rank 0's
        "distributed_type": acc.distributed_type.value,
        **run.backend.summary_facts(acc),  # fsdp_version, zero_stage
        "mixed_precision": acc.mixed_precision,
        "total_params": run.shards.total_params,
        "trainable_params": trainable,
        **run.task.peft.summary_facts(),
        "objective": run.cfg.objective,
        "method": run.cfg.objective,  # the same, under the flag's name, as summaries have always said
        **run.task.summary_facts(),  # a preference run's reference: its parameters on each rank
        "fsdp_units": run.fsdp_units,
        "parallelism": run.shards.mesh.as_dict(),  # dp_replicate x dp_shard x tp, read from the prepared parameters
        "local_params_per_rank": run.shards.local_params_per_rank,
        "peak_memory_bytes_per_rank": gather_ints(acc, peak_memory_bytes(acc, run.host)),
        # Host RAM (resident set) per rank: after the imports, its peak until the
        # model was loaded and sharded, and how far the final save raised it.
        "rss_after_imports_bytes_per_rank": gather_ints(acc, run.host.at_start),
        "load_peak_rss_bytes_per_rank": gather_ints(acc, run.load_peak_rss),
        "final_save_rss_rise_bytes_per_rank": gather_ints(acc, final_save_rss_rise),
        "state_bytes_per_rank": gather_ints(acc, sum(kind["bytes"] for kind in state.values())),
        # Parameters, gradients and optimizer state (an engine's fp32 master copies included) per rank.
        "state_elements_per_rank": {name: gather_ints(acc, state[name]["elements"])
                                    for name in ("params", "grads", "optimizer")},
        "train_time_s": run.train_seconds,
        "steps": run.progress.step,
        "final_loss": run.last_loss,
        "metric": run.task.metric_name,
        "first_eval": run.evals[0][1] if run.evals[0][0] == 0 else None,
        "last_eval": run.evals[-1][1],
        "final_model_dir": str(final_dir),
        "sources": run.sources.summary(),  # examples and tokens training consumed from each --dataset
    }
