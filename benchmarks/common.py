"""Helpers shared by benchmark modules: timing callbacks and small Trainer runs."""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

import lightning as L
import torch


class StepTimer(L.Callback):
    """Wall time between consecutive training-batch starts: the whole step, every callback included."""

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
        self._start = None  # validation / epoch boundaries are not steps

    @property
    def median_s(self) -> float:
        times = self.times[self.skip_first :] or self.times
        return statistics.median(times)


def quiet_trainer(**kwargs: Any) -> L.Trainer:
    """A Trainer with no logger, progress bar, checkpointing or summary (benchmarks print their own)."""
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    defaults.update(kwargs)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    return L.Trainer(**defaults)


def mib(num_bytes: float) -> float:
    return round(num_bytes / 2**20, 2)


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
