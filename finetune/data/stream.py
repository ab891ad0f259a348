"""The training batches of a run as a stream with a position: the loop takes
each optimizer step's micro-batches from it and never measures the data, and
every checkpoint keeps its `state_dict()` (in training_progress.json).

`EpochBatches` serves map-style data: each epoch is one pass in an order that
depends on (seed, epoch) only, split over the ranks by Accelerate's prepared
loader. Its position is the number of samples all ranks together consumed in
the current epoch; a resume skips them, rounded down to whole global batches
when the world size changed.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol

from finetune.errors import UsageError

# No library at import: `finetune export` reads checkpoints through this
# module, and `finetune resume` checks a stream's position before any loads.
if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from finetune.data.mixture import RowStream


class DataState(Protocol):
    """What a checkpoint saves of the data (every rank calls `state_dict`)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class EpochBatches:
    def __init__(self, loader: DataLoader | None, accelerator: Accelerator, global_batch: int):
        self.loader = loader              # prepared by Accelerate: this rank's share of each batch
        self.accelerator = accelerator
        self.global_batch = global_batch  # samples all ranks take per micro-batch
        self.samples_in_epoch = 0
        self._epoch: int | None = None    # the epoch the open iterator is over
        self._batches: Iterator[dict] | None = None

    def steps_per_epoch(self, accumulation: int) -> int | None:
        """Optimizer steps in one pass (None where a pass has no known length).
        The last micro-batches of an epoch make a step even when fewer than
        `accumulation` are left."""
        return math.ceil(len(self.loader) / accumulation)

    def state_dict(self) -> dict[str, int]:
        return {"samples_in_epoch": self.samples_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.samples_in_epoch, self._batches = self.checked_position(state), None

    @staticmethod
    def checked_position(state: dict, where: str = "the checkpoint") -> int:
        """The position a state dict holds, refused in one line when it is not one."""
        samples = state.get("samples_in_epoch", 0)
        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
            raise UsageError(f"{where}: the data position (samples_in_epoch: {samples!r}) is not a count of samples; "
                             "the checkpoint is damaged, resume from an earlier one")
        return samples

    def take(self, epoch: int, count: int) -> list[dict]:
        """This rank's next `count` micro-batches of `epoch` (fewer at its end,
        none when it is over); the position moves past them."""
        if self._batches is None or self._epoch != epoch:
            self._batches = self._rest_of(epoch)
        micro_batches = list(itertools.islice(self._batches, count))
        self.samples_in_epoch += self.global_batch * len(micro_batches)
        return micro_batches

    @property
    def epoch_ended(self) -> bool:
        """Whether the micro-batches taken last included the epoch's last one."""
        return self.accelerator.gradient_state.end_of_dataloader

    def end_epoch(self) -> None:
        self.samples_in_epoch, self._batches = 0, None

    def _rest_of(self, epoch: int) -> Iterator[dict]:
        skip = self.samples_in_epoch // self.global_batch
        self.samples_in_epoch = skip * self.global_batch
        batches = self.accelerator.skip_first_batches(self.loader, skip) if skip else self.loader
        batches.set_epoch(epoch)
        self._epoch = epoch
        return iter(batches)


class StreamBatches:
    """Streamed data: each rank reads its own part of the sources
    (mixture.RowStream), and the ranks agree on every step's micro-batch
    count, so that a pass ends on all of them at once (what some ranks still
    hold of that pass is skipped, and said). Its position is every rank's
    position in its own stream: a resume needs the same number of ranks."""

    def __init__(self, stream: RowStream, accelerator: Accelerator, per_device_batch: int, collate):
        self.stream, self.accelerator = stream, accelerator
        self.per_device_batch, self.collate = per_device_batch, collate
        self.position: dict | None = None           # after the last row taken (None: the start of the pass)
        self._rows: Iterator[tuple[dict, dict]] | None = None
        self._ahead: list[tuple[dict, dict]] | None = None  # the next micro-batch, read ahead to see a pass end
        self._epoch: int | None = None
        self.epoch_ended = False

    def steps_per_epoch(self, accumulation: int) -> None:
        return None

    def state_dict(self) -> dict:
        """A collective: every rank's position, gathered for the main process to save."""
        from accelerate.utils import gather_object

        return {"stream_positions": gather_object([self.position])}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state.get("stream_positions"), list):
            raise UsageError("the checkpoint holds no stream position (it was written by a run without --streaming); "
                             "resume it without --streaming")
        self.check_world_size(state, self.accelerator.num_processes)
        position = state["stream_positions"][self.accelerator.process_index]
        if position is not None and not (isinstance(position, dict) and isinstance(position.get("chunk"), dict)
                                         and isinstance(position.get("used"), int)
                                         and isinstance(position.get("builder"), dict)):
            raise UsageError(f"the checkpoint's stream position of rank {self.accelerator.process_index} is not one "
                             "(chunk, used, builder); the checkpoint is damaged, resume from an earlier one")
        self.position, self._rows, self._ahead = position, None, None

    @staticmethod
    def check_world_size(state: dict, world: int) -> None:
        """A stream's position is each rank's own: it carries over to the same number of ranks only."""
        positions = state.get("stream_positions")
        if isinstance(positions, list) and len(positions) != world:
            raise UsageError(f"the checkpoint's stream positions are those of {len(positions)} ranks, each in its own "
                             f"part of the data, and this resume has {world}; resume with --num_processes "
                             f"{len(positions)} (which rank reads which part depends on their number)")

    def take(self, epoch: int, count: int) -> list[dict]:
        """This rank's next `count` micro-batches (fewer at the end of a pass).
        A rank that cannot read its data stops every rank, with its reason."""
        batches: list[list[tuple[dict, dict]]] = []
        error = ""
        try:
            self._read(epoch, count, batches)
        except UsageError as e:  # a damaged file: the others must not wait for this rank in the next collective
            error = str(e)
        # Every rank takes as many micro-batches as the one with the fewest.
        from accelerate.utils import gather_object

        counts = gather_object([(len(batches), self._ahead is None, error)])
        if errors := [message for _, _, message in counts if message]:
            raise UsageError(errors[0])
        usable = min(n for n, _, _ in counts)
        self.epoch_ended = usable < count or any(ended for _, ended, _ in counts)
        if usable == 0:
            empty = [rank for rank, (n, _, _) in enumerate(counts) if n == 0]
            raise UsageError(f"rank(s) {', '.join(map(str, empty))} have no batch of {self.per_device_batch} rows in "
                             f"pass {epoch + 1} of the stream; give the data more examples or shards, or lower "
                             "--per_device_batch_size or the number of processes")
        left = sum(n for n, _, _ in counts) - usable * len(counts)
        if self.epoch_ended and left:
            self.accelerator.print(f"pass {epoch + 1} of the stream ended on a rank with fewer batches: {left} "
                                   "micro-batch(es) the other ranks still held of it are skipped")
        taken = batches[:usable]
        self.position = taken[-1][-1][1]
        return [self.collate([row for row, _ in rows]) for rows in taken]

    def end_epoch(self) -> None:
        self.position, self._rows, self._ahead = None, None, None

    def _read(self, epoch: int, count: int, batches: list) -> None:
        """Up to `count` micro-batches of rows into `batches`, the next one read
        ahead (a pass ends with the last full micro-batch)."""
        if self._rows is None or self._epoch != epoch:
            self._rows, self._epoch = self.stream.rows(epoch, self.position), epoch
            try:
                self._ahead = self._full_batch()
            except Exception as e:  # right after a resume: the position may be what does not fit
                if self.position is None:
                    raise
                raise UsageError(f"{str(e) if isinstance(e, UsageError) else f'{type(e).__name__}: {e}'} (at the "
                                 f"first rows after the checkpoint's stream position of rank "
                                 f"{self.accelerator.process_index}: if the data is intact, that position is damaged; "
                                 "resume from an earlier checkpoint)") from None
        while len(batches) < count and self._ahead is not None:
            batches.append(self._ahead)
            self._ahead = self._full_batch()

    def _full_batch(self) -> list[tuple[dict, dict]] | None:
        """The next micro-batch's rows; None when the pass has too few left (they are dropped)."""
        rows = list(itertools.islice(self._rows, self.per_device_batch))
        return rows if len(rows) == self.per_device_batch else None


class SourceTally:
    """The examples and tokens training consumed from each source, over all
    ranks, from the rows' per-source counts (mixture.py); saved with every
    checkpoint beside the position. Rows without counts (a single map-style
    source) count as one source: their rows and real tokens."""

    def __init__(self, names: list[str], weights: list[float]):
        self.names, self.weights = names, weights
        self.examples, self.tokens = [0] * len(names), [0] * len(names)

    def local_counts(self, micro_batches: list[dict]) -> list[float]:
        """This rank's examples then tokens per source in `micro_batches`; the counts leave the batches."""
        examples, tokens = [0.0] * len(self.names), [0.0] * len(self.names)
        for batch in micro_batches:
            if "source_tokens" in batch:
                examples = [a + b for a, b in zip(examples, batch.pop("source_examples").sum(0).tolist())]
                tokens = [a + b for a, b in zip(tokens, batch.pop("source_tokens").sum(0).tolist())]
            else:  # one source: rows (images, blocks, examples) and their real tokens
                examples[0] += len(next(iter(batch.values())))
                if "input_ids" in batch:
                    mask = batch.get("attention_mask")
                    tokens[0] += float(mask.sum() if mask is not None else batch["input_ids"].numel())
        return examples + tokens

    def add(self, counts: list[float]) -> None:
        """Counts over all ranks, as `local_counts` lays them out."""
        n = len(self.names)
        self.examples = [a + round(b) for a, b in zip(self.examples, counts[:n])]
        self.tokens = [a + round(b) for a, b in zip(self.tokens, counts[n:])]

    def state_dict(self) -> dict:
        return {"sources_consumed": {"examples": self.examples, "tokens": self.tokens}}

    def load_state_dict(self, state: dict) -> None:
        consumed = state.get("sources_consumed")
        if isinstance(consumed, dict) and len(consumed.get("tokens", [])) == len(self.names):
            self.examples, self.tokens = list(consumed["examples"]), list(consumed["tokens"])

    def summary(self) -> list[dict]:
        return [{"dataset": name, "weight": weight, "examples": examples, "tokens": tokens}
                for name, weight, examples, tokens in zip(self.names, self.weights, self.examples, self.tokens)]

    def log_row(self) -> dict[str, int]:
        """metrics.jsonl's running token count per source, by the source's file or dataset name."""
        labels = [Path(name.rstrip("/")).name or name for name in self.names]
        if len(set(labels)) < len(labels):
            labels = [f"{i}_{label}" for i, label in enumerate(labels)]
        return {f"tokens/{label}": tokens for label, tokens in zip(labels, self.tokens)} if len(self.names) > 1 else {}
