"""Helpers shared by benchmark modules: timing callbacks and small Trainer runs."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch

from lightning_lowmem.demo.timing import StepTimer

__all__ = ["StepTimer", "mib", "quiet_trainer", "set_seed"]


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
