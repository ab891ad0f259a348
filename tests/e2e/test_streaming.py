"""Streamed data and mixtures of sources: the files a stream reads, the rows
it builds and their position (exact from any row), mixture weights, and real
2-process FSDP runs that stop on SIGTERM and resume with the same losses."""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, check_ok, run_cli, run_in_process, stopped_by_sigterm, train_rows
from sft_models import CHATML, chat_tokenizer, conversations

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega").split()


def documents(count: int, seed: int, words: tuple[int, int] = (8, 14)) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(count)]


def write_shards(root: Path, name: str, rows: list[dict], shards: int, suffix: str = ".jsonl.gz") -> Path:
    """`rows` over `shards` files root/name/train-0000N.jsonl.gz, in order."""
    folder = root / name
    folder.mkdir(parents=True)
    per = -(-len(rows) // shards)
    for shard in range(shards):
        text = "".join(json.dumps(row) + "\n" for row in rows[shard * per:(shard + 1) * per])
        path = folder / f"train-{shard:05d}{suffix}"
        if suffix.endswith(".gz"):
            with gzip.open(path, "wt") as f:
                f.write(text)
        else:
            path.write_text(text)
    return folder


# --- files ----------------------------------------------------------------------------------------

def test_every_file_form_reads_the_same_rows_streamed_and_not(tmp_path):
    """jsonl (plain, .gz, .zst), parquet, txt, a dir and a glob; a dir's or a
    glob's validation files stay a validation split."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from finetune.data.sources import load_source
    from finetune.data.locations import TEXT_FILES
    from finetune.data.text import _txt_options

    docs = documents(30, seed=1)
    rows = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    (tmp_path / "plain.jsonl").write_text(rows)
    with gzip.open(tmp_path / "zipped.jsonl.gz", "wt") as f:
        f.write(rows)
    (tmp_path / "packed.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows.encode()))
    pq.write_table(pa.table({"text": docs}), tmp_path / "table.parquet")
    (tmp_path / "prose.txt").write_text("\n\n".join(docs) + "\n")
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        (shards / f"train-{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[i * 10:(i + 1) * 10]))
    (shards / "validation-0.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")

    def read(dataset: str, streaming: bool) -> dict[str, list[str]]:
        raw = load_source(dataset, lambda: None, TEXT_FILES, "text files", builder_options=_txt_options("paragraph"),
                          streaming=streaming)
        return {split: [row["text"].strip("\n") for row in rows] for split, rows in raw.items()}

    for dataset in ("plain.jsonl", "zipped.jsonl.gz", "packed.jsonl.zst", "table.parquet", "prose.txt"):
        for streaming in (False, True):
            assert read(str(tmp_path / dataset), streaming) == {"train": docs}, (dataset, streaming)
    for dataset in (str(shards), str(shards / "*.jsonl")):
        for streaming in (False, True):
            assert read(dataset, streaming) == {"train": docs, "validation": ["held out"]}, (dataset, streaming)


def test_sources_and_weights_from_yaml_lists_or_the_command_line(tmp_path):
    from finetune.cli import parse
    from finetune.config import load_config

    (tmp_path / "run.yaml").write_text("dataset: [a.jsonl, b.jsonl]\ndataset_weights: [3, 1]\nmixture_stop: all_exhausted\n")
    from_yaml = load_config(tmp_path / "run.yaml", {})
    args = parse(["train", "--dataset", "a.jsonl", "b.jsonl", "--dataset_weights", "3", "1",
                  "--mixture_stop", "all_exhausted"])
    from_cli = load_config(None, {k: getattr(args, k) for k in ("dataset", "dataset_weights", "mixture_stop")})
    assert from_yaml == from_cli
    assert from_yaml.sources == ["a.jsonl", "b.jsonl"] and from_yaml.source_weights == [0.75, 0.25]
    one = load_config(None, {"dataset": ["a.jsonl"]})
    assert one.dataset == "a.jsonl" and one.sources == ["a.jsonl"] and one.source_weights == [1.0]


# --- rows and their positions ---------------------------------------------------------------------

def _sources(tmp_path: Path, stop: str = "first_exhausted"):
    from finetune.data.mixture import Source

    text = [{"text": d} for d in documents(60, seed=2, words=(3, 40))]
    chat = conversations(40, seed=3)
    return [Source("text", 0.6, "text", lambda: text), Source("chat", 0.4, "chat", lambda: chat)]


@pytest.mark.parametrize("mode", ["blocks", "packed", "examples"])
def test_a_stream_resumed_from_any_row_continues_with_the_same_rows(mode, tmp_path, monkeypatch):
    """The position after every row, through JSON as a checkpoint keeps it,
    gives the rest of the pass exactly, across chunk boundaries, whatever the
    number of encoding workers."""
    from finetune.data import mixture
    from finetune.data.mixture import Encoder, RowStream

    monkeypatch.setattr(mixture, "CHUNK", 7)  # many chunks, and positions inside them
    sources = _sources(tmp_path)
    if mode == "blocks":
        sources = sources[:1]
    tokenizer = chat_tokenizer(documents(50, seed=4) + [m["content"] for c in conversations(20) for m in c["messages"]])
    encoder = Encoder(tokenizer, sources, 48, train_on_prompt=False, long_examples="truncate",
                      pieces=mode != "blocks")

    def stream(workers: int = 0) -> RowStream:
        return RowStream(sources, encoder, mode, 48, "first_exhausted", seed=5, rank=1, workers=workers)

    whole = list(stream().rows(0))
    rows = [row for row, _ in whole]
    assert len(rows) > 20
    with_workers = stream(workers=2)
    assert [row for row, _ in with_workers.rows(0)] == rows
    with_workers.close()
    for k in range(0, len(whole), 3):
        position = json.loads(json.dumps(whole[k][1]))
        assert [row for row, _ in stream().rows(0, position)] == rows[k + 1:], k
    # Another pass draws its sources anew; the same pass again is the same.
    assert [row for row, _ in stream().rows(0)] == rows
    if mode != "blocks":
        assert [row for row, _ in stream().rows(1)] != rows
    counted = [sum(row["source_tokens"]) for row in rows]
    assert counted == [len(row["input_ids"]) for row in rows]


def test_a_checkpoint_position_that_is_not_one_is_refused_in_one_line(tmp_path):
    """Another number of ranks, a position of the wrong shape, and one whose
    reader state the data cannot take: each a UsageError naming the fix."""
    from types import SimpleNamespace

    from finetune.data.chat import stack_rows
    from finetune.data.mixture import Encoder, RowStream, Source
    from finetune.data.stream import StreamBatches
    from finetune.errors import UsageError

    rows = [{"text": d} for d in documents(40, seed=12)]
    sources = [Source("text", 1.0, "text", lambda: rows)]
    encoder = Encoder(chat_tokenizer(documents(40, seed=12)), sources, 16, False, "truncate", pieces=False)
    stream = RowStream(sources, encoder, "blocks", 16, "first_exhausted", seed=0, rank=0)
    good = [position for _, position in stream.rows(0)][3]
    batches = StreamBatches(stream, SimpleNamespace(num_processes=1, process_index=0), 2, stack_rows)
    with pytest.raises(UsageError, match="those of 2 ranks.*resume with --num_processes 2"):
        batches.load_state_dict({"stream_positions": [good, good]})
    with pytest.raises(UsageError, match="is not one .chunk, used, builder.; the checkpoint is damaged"):
        batches.load_state_dict({"stream_positions": [{"chunk": [], "used": "3"}]})
    with pytest.raises(UsageError, match="holds no stream position .* resume it without --streaming"):
        batches.load_state_dict({"samples_in_epoch": 8})
    bad = json.loads(json.dumps(good))
    bad["chunk"]["readers"][0] = {"index": "nowhere"}
    batches.load_state_dict({"stream_positions": [bad]})
    with pytest.raises(UsageError, match="after the checkpoint's stream position of rank 0: if the data is intact"):
        batches.take(0, 1)
    # Values no stream could have left: each refused before a row is built, never read as other data.
    for damage in (lambda p: p["builder"]["carry"].append(-5), lambda p: p["builder"]["carry"].extend([1] * 99),
                   lambda p: p["builder"]["carry_sources"].append([7, 1, 1]), lambda p: p.update(used=10**6),
                   lambda p: p["chunk"].update(numbers=[1, 2]), lambda p: p["chunk"]["readers"][0].update(index=10**6),
                   lambda p: p["builder"].update(ready=[{"input_ids": [1] * 17, "labels": [1] * 17}])):
        bad = json.loads(json.dumps(good))
        damage(bad)
        batches.load_state_dict({"stream_positions": [bad]})
        with pytest.raises(UsageError, match="the checkpoint's stream position is not one this data can take"):
            batches.take(0, 1)


def test_a_mixture_stops_when_its_first_source_runs_out_or_when_all_have(tmp_path):
    from finetune.data.mixture import Encoder, RowStream, Source

    small = [{"text": f"small {i}"} for i in range(10)]
    large = [{"text": f"large {i}"} for i in range(200)]
    sources = [Source("small", 0.5, "text", lambda: small), Source("large", 0.5, "text", lambda: large)]
    tokenizer = chat_tokenizer(["small large"] + [str(i) for i in range(200)])
    encoder = Encoder(tokenizer, sources, 1, False, "truncate", pieces=False)

    def examples(stop: str) -> list[int]:
        rows = [row for row, _ in RowStream(sources, encoder, "examples", 64, stop, seed=0, rank=0).rows(0)]
        return [sum(row["source_examples"][i] for row in rows) for i in range(2)]

    first = examples("first_exhausted")
    assert first[0] == 10 and 0 < first[1] < 40  # the small source ran out first; about as many of the large
    every = examples("all_exhausted")
    assert every[1] == 200 and every[0] > 100  # the small one started over until the large one ran out


def test_held_out_rows_are_chosen_by_content_and_never_trained_on(tmp_path):
    from finetune.config import load_config
    from finetune.data.mixture import is_held_out
    from finetune.data.text import load_sources

    rows = [{"text": d} for d in documents(2000, seed=6)]
    data = write_shards(tmp_path, "data", rows, shards=4)
    cfg = load_config(None, {"dataset": str(data), "streaming": True, "max_steps": 1, "max_eval_samples": 50,
                             "validation_split": 0.1}).resolved()
    trained = []
    for rank in range(2):
        loaded = load_sources(cfg, rank, 2)
        assert len(loaded.validation[0]) == 50
        trained += [row["text"] for row in loaded.sources[0].open() if not is_held_out(row, 0.1)]
    held = {row["text"] for row in load_sources(cfg, 0, 2).validation[0]}
    fraction = sum(is_held_out(row, 0.1) for row in rows) / len(rows)
    assert 0.07 < fraction < 0.13
    # Each rank reads two whole shards (4 shards over 2 ranks), and a held-out row is in neither.
    assert sorted(trained) == sorted(row["text"] for row in rows if not is_held_out(row, 0.1))
    assert not held & set(trained)


# --- real runs ------------------------------------------------------------------------------------

STREAM_ARGS = ["--model", "tiny-gpt2", "--streaming", "--block_size", "32", "--per_device_batch_size", "4",
               "--sample_prompt", "", "--max_eval_samples", "16", "--log_format", "plain", "--log_every", "1",
               "--learning_rate", "3e-3", "--seed", "3"]


@pytest.fixture(scope="module")
def stream_data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stream-data")
    chat_template = root / "chatml.jinja"
    chat_template.write_text(CHATML)
    return {"text": write_shards(root, "text", [{"text": d} for d in documents(3000, seed=7)], shards=4),
            "chat": write_shards(root, "chat", conversations(1500, seed=8), shards=2, suffix=".jsonl"),
            "template": chat_template}


STOPPED_STEPS = 20  # the stop lands after the first checkpoint (step 4), mid-stream


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "packed chat"])
def test_a_stream_stopped_by_sigterm_resumes_with_the_uninterrupted_losses(kind, stream_data, tmp_path, env):
    """2-process FSDP, fp32: the resumed run's losses equal the uninterrupted
    run's to 1e-6 at every step, its data read by 2 encoding workers per rank
    (the rows do not depend on them)."""
    data = (["--dataset", stream_data["text"]] if kind == "text" else
            ["--dataset", stream_data["chat"], "--packing", "--chat_template", stream_data["template"],
             "--block_size", "128"])
    args = [*STREAM_ARGS, *data, "--max_steps", str(STOPPED_STEPS), "--checkpoint_every", "4"]
    whole = tmp_path / "whole"
    check_ok(run_cli(["train", *args, "--output_dir", whole], env, mixed_precision="no", warm=True))

    stopped = tmp_path / "stopped"
    err = stopped_by_sigterm(["train", *args, "--output_dir", stopped, "--dataloader_num_workers", "2"], env,
                             stopped / "checkpoints" / "step_000004")
    stop = re.search(r"stopped: SIGTERM at step (\d+)", err)
    assert stop, err[-3000:]
    assert int(stop.group(1)) < STOPPED_STEPS
    check_ok(run_cli(["resume", stopped], env, nproc=None, timeout=300))

    expected, got = train_rows(whole), train_rows(stopped)
    assert [r["step"] for r in got] == list(range(1, STOPPED_STEPS + 1))
    assert all(abs(a["loss"] - b["loss"]) <= 1e-6 for a, b in zip(expected, got)), [
        (a["step"], a["loss"], b["loss"]) for a, b in zip(expected, got) if abs(a["loss"] - b["loss"]) > 1e-6]
    summaries = [json.loads((run / "summary.json").read_text()) for run in (whole, stopped)]
    assert summaries[0]["sources"] == summaries[1]["sources"]
    assert summaries[1]["local_params_per_rank"][0] < summaries[1]["total_params"]  # sharded, not replicated


@pytest.mark.slow
def test_a_mixture_consumes_tokens_by_its_weights(stream_data, tmp_path, env):
    """Two sources of like documents, weights 0.8 / 0.2, a few thousand
    documents over 2 ranks: the tokens consumed follow the weights within 5%,
    and summary.json, metrics.jsonl and the console say how many."""
    other = write_shards(tmp_path, "other", [{"text": d} for d in documents(3000, seed=9)], shards=2)
    run = tmp_path / "mix"
    proc = run_cli(["train", *STREAM_ARGS, "--dataset", stream_data["text"], other, "--dataset_weights", "4", "1",
                    "--max_steps", "30", "--per_device_batch_size", "16", "--block_size", "64",
                    "--output_dir", run], env, mixed_precision="no", warm=True)
    check_ok(proc)
    sources = json.loads((run / "summary.json").read_text())["sources"]
    assert [(s["dataset"], s["weight"]) for s in sources] == [(str(stream_data["text"]), 0.8), (str(other), 0.2)]
    tokens = [s["tokens"] for s in sources]
    assert sum(tokens) == 30 * 2 * 16 * 64  # every token of every block, counted once
    assert sum(s["examples"] for s in sources) > 2000
    assert abs(tokens[0] / sum(tokens) - 0.8) <= 0.05, tokens
    last = train_rows(run)[-1]
    assert [last["tokens/text"], last["tokens/other"]] == tokens
    assert f"tokens/text {tokens[0]:,}" in proc.stdout


@pytest.mark.slow
def test_a_mixture_without_streaming_is_drawn_once_and_shuffled(stream_data, tmp_path, env):
    """Text and packed chat from two sources, map-style, 2-process FSDP: every
    rank draws the same rows (Accelerate's loader then splits them), and both
    sources are trained on."""
    run = tmp_path / "mix"
    proc = run_cli(["train", *[a for a in STREAM_ARGS if a != "--streaming"], "--dataset", stream_data["text"],
                    stream_data["chat"], "--dataset_weights", "0.5", "0.5", "--chat_template", stream_data["template"],
                    "--block_size", "128", "--max_steps", "6", "--output_dir", run], env, mixed_precision="no",
                   warm=True)
    check_ok(proc)
    layout = next(line for line in proc.stdout.splitlines() if line.startswith("FSDP on 2"))
    drawn = re.search(r"2 sources \(text, chat\) drawn with weights 0.5 0.5 until first exhausted: (\d+) train", layout)
    assert drawn, layout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data_format"] == "mixture"
    assert all(s["tokens"] > 0 and s["examples"] > 0 for s in summary["sources"]), summary["sources"]
    assert sum(s["tokens"] for s in summary["sources"]) <= 6 * 2 * 4 * 128


def _first_step_and_peak(args: list, env: dict, log: Path) -> tuple[float, float, int]:
    """A one-process run in a fresh child: its CPU seconds (all threads) and
    wall seconds until the first step's line, and its own peak resident set
    (wait4's, this child's alone)."""
    start = time.perf_counter()
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "finetune", "train", *map(str, args)], env=env, cwd=REPO,
                                stdout=subprocess.PIPE, stderr=err, text=True)
        cpu = wall = None
        for line in proc.stdout:
            if cpu is None and line.startswith("step 1/"):
                wall = time.perf_counter() - start
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0 and cpu is not None, log.read_text()[-3000:]
    return cpu, wall, usage.ru_maxrss * 1024


@pytest.mark.slow
def test_a_ten_times_larger_stream_starts_as_fast_in_as_little_memory(tmp_path, env):
    """Nothing is read ahead: neither the work before the first step nor the
    peak resident set grows with the corpus. The work is measured in CPU
    seconds, which the suite's other worker does not inflate (wall time is
    held loosely)."""
    docs = documents(20_000, seed=10, words=(20, 60))
    small = write_shards(tmp_path, "small", [{"text": d} for d in docs], shards=4)
    large = write_shards(tmp_path, "large", [{"text": d} for d in docs * 10], shards=4)
    assert sum(f.stat().st_size for f in large.iterdir()) > 9 * sum(f.stat().st_size for f in small.iterdir())
    runs = {name: _first_step_and_peak([*STREAM_ARGS, "--dataset", corpus, "--max_steps", "3",
                                        "--output_dir", tmp_path / name], env, tmp_path / f"{name}.log")
            for name, corpus in (("small", small), ("large", large))}
    print(runs)
    (small_cpu, small_wall, small_peak), (large_cpu, large_wall, large_peak) = runs["small"], runs["large"]
    assert large_cpu <= 1.5 * small_cpu + 2, runs  # tokenizing it all first: about 30 s more
    assert large_wall <= 2 * small_wall + 10, runs
    assert large_peak <= small_peak + 64 * 2**20, runs


# --- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, words", [
    (["--dataset", "{text}", "/nonexistent/more.jsonl"], "--dataset /nonexistent/more.jsonl does not exist"),
    (["--dataset", "{text}", "{text}", "--dataset_weights", "1"], "1 weight(s) for 2 --dataset source(s)"),
    (["--dataset", "{text}", "{text}", "--dataset_weights", "0", "0"], "with a positive, finite sum"),
    (["--dataset", "{text}", "--streaming", "--max_steps", "0", "--num_epochs", "1"], "--streaming needs --max_steps"),
    (["--dataset", "{text}/nothing-*.jsonl"], "matches no file"),
])
def test_bad_sources_are_one_line(options, words, stream_data, tmp_path, env):
    options = [o.format(text=stream_data["text"]) for o in options]
    proc = run_in_process("train", "--model", "tiny-gpt2", "--max_steps", "2", *options,
                          "--output_dir", tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_shard_damaged_mid_stream_stops_every_rank_in_one_line_and_keeps_the_checkpoints(tmp_path, env):
    rows = [{"text": d} for d in documents(4000, seed=11)]
    data = write_shards(tmp_path, "data", rows, shards=4, suffix=".jsonl")
    # Rank 1's second shard, read after a few checkpoints (and after the first
    # 2000 rows, which a preset's tokenizer is trained on).
    damaged = data / "train-00003.jsonl"
    lines = damaged.read_text().splitlines(keepends=True)
    damaged.write_text("".join(lines[:600]) + '{"text": "cut off\n' + "".join(lines[600:]))
    run = tmp_path / "run"
    proc = run_cli(["train", *STREAM_ARGS, "--dataset", data, "--max_steps", "200", "--checkpoint_every", "5",
                    "--per_device_batch_size", "16", "--block_size", "64", "--output_dir", run], env,
                   mixed_precision="no")
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not read --dataset" in errors[0] and "part-way through" in errors[0], output[-3000:]
    assert "resume from the last checkpoint" in errors[0]
    assert "exitcode  : 2" in output and "[rank" not in output and str(REPO / "finetune") not in output  # no worker traceback
    assert proc.returncode != 0
    from finetune.checkpoint import verify_checkpoint
    from finetune.run_dir import complete_checkpoints

    checkpoints = complete_checkpoints(run)
    assert checkpoints and int(checkpoints[-1].name.removeprefix("step_")) >= 5  # written before the damage was read
    verify_checkpoint(checkpoints[-1], allow_unverified=False)  # its manifest still matches every file
    assert not any(p.name.startswith(".tmp") for p in (run / "checkpoints").iterdir())
