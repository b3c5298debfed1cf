"""`StepTimer`: wall time per training step, every callback included (used by demo and benchmarks)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L


class StepTimer(L.Callback):
    """Wall time between consecutive training-batch starts.

    Args:
        skip_first: steps left out of :attr:`median_s` (warm-up, compilation). Default: 2.
    """

    def __init__(self, skip_first: int = 2) -> None:
        self.skip_first = skip_first
        self.times: list[float] = []
        self._start: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self._start is not None:
            self.times.append(now - self._start)
        self._start = now

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._start = None  # validation and epoch boundaries are not steps

    @property
    def median_s(self) -> float:
        """Median step time in seconds, after the warm-up steps."""
        times = self.times[self.skip_first :] or self.times
        return statistics.median(times) if times else float("nan")
