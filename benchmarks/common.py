"""Helpers shared by benchmark modules: timing callbacks, small Trainer runs, CUDA peak measurement."""

from __future__ import annotations

import gc
import os
import time
import warnings
from typing import Any, Callable

import lightning as L
import torch

from lightning_lowmem.demo.timing import StepTimer

__all__ = [
    "CudaPeak",
    "StepTimer",
    "clear_cuda_workspaces",
    "cuda_peak",
    "mib",
    "quiet_trainer",
    "set_seed",
    "smoke",
    "synchronize",
    "timed",
]

SMOKE_ENV = "LOWMEM_BENCH_SMOKE"
"""Set to ``1`` by ``python -m benchmarks --smoke``: the dry run of ``scripts/gpu_check.py`` runs every
benchmark with tiny settings, on the same code paths, to catch breakage in seconds (numbers meaningless)."""


def smoke() -> bool:
    """True in a smoke run (``python -m benchmarks --smoke``): shrink every size and step count to a minimum."""
    return os.environ.get(SMOKE_ENV) == "1"


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


def synchronize(device: str | torch.device) -> None:
    """Wait for queued kernels on a CUDA ``device`` (no-op on CPU): call before reading a host clock."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str | torch.device) -> float:
    """Wall seconds of ``fn()``, the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def clear_cuda_workspaces() -> None:
    """Free the cuBLAS / cuBLASLt workspaces torch keeps per (handle, stream) through the caching allocator.

    They are allocated on a thread's first matmul and then stay; measuring each configuration from a clean
    slate (workspace included, as ``estimate_memory`` predicts it) needs them gone. Private:
    ``torch._C._cuda_clearCublasWorkspaces`` has no public twin (torch 2.0-2.13 all have it).
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class CudaPeak:
    """``torch.cuda.max_memory_allocated`` over a region, relative to what was allocated when it began.

    Attributes (after the block):
        baseline: bytes allocated at entry (tensors that existed before).
        peak: the allocator's peak inside the block, baseline included.
        peak_above_baseline: ``peak - baseline``.
        after: bytes allocated at exit.
    """

    def __enter__(self) -> "CudaPeak":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.baseline = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()
        self.after = torch.cuda.memory_allocated()
        self.peak_above_baseline = self.peak - self.baseline


def cuda_peak(fn: Callable[[], Any]) -> int:
    """Absolute ``torch.cuda.max_memory_allocated`` while ``fn()`` runs (peak stats reset first)."""
    with CudaPeak() as peak:
        fn()
    return peak.peak
