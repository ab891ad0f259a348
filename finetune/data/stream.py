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
from typing import Iterator

from accelerate import Accelerator
from torch.utils.data import DataLoader

from finetune.errors import UsageError


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
