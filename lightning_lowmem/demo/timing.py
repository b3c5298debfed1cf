"""Time, as the demo and the benchmarks see it: `StepTimer` (wall time per training step),
`StepProgress` (a progress display counted in optimizer steps), `bf16_speed` (is bf16 native here?) and
`pinned_threads` (the demo's runs on a fixed number of torch threads)."""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar


@contextlib.contextmanager
def pinned_threads(count: int = 1) -> Iterator[None]:
    """``torch.set_num_threads(count)`` for the block, the previous count restored after.

    The demo's runs (as the benchmarks) use one thread: its models are small, so a second thread gains little,
    and on a shared machine two OpenMP threads spin-wait on each other (one 200-step charlm run took 469 s with two
    threads on two busy cores); one thread slows only in proportion to the load.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


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


# ----------------------------------------------------------------------------- progress
class StepProgress(TQDMProgressBar):
    """Lightning's progress bar counted in optimizer steps over the whole run, under a fixed title.

    Lightning's own bar counts the batches of the current epoch and titles itself ``Epoch N`` (or
    ``Epoch 0/-2`` for a run bounded by ``max_steps``); a demo row wants "step 40/200". When stderr is
    not a terminal (a log file, CI) the bar is replaced by a plain line at each quarter of the run.

    Args:
        title: text in front of the bar, e.g. ``"2/7 charlm bf16-true"``. Default: ``""``.
    """

    def __init__(self, title: str = "") -> None:
        super().__init__(leave=False)
        self.title = title
        self.interactive = sys.stderr.isatty()
        self._total: int | None = None
        self._started = time.perf_counter()
        self._printed = 0
        if not self.interactive:
            self.disable()

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:  # noqa: D102
        super().on_train_start(trainer, *args)
        total = trainer.estimated_stepping_batches
        self._total = int(total) if total not in (None, float("inf")) else None
        self._started = time.perf_counter()

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:  # noqa: D102
        bar = self.train_progress_bar
        if trainer.current_epoch == 0 or bar.total != self._total:
            bar.reset(total=self._total)
        bar.set_description(self.title)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:  # noqa: D102
        step = trainer.global_step
        bar = self.train_progress_bar
        if not bar.disable:
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()
        elif self._total and step * 4 // self._total > self._printed:
            self._printed = step * 4 // self._total
            elapsed = time.perf_counter() - self._started
            print(f"    step {step}/{self._total} ({elapsed:.0f} s)", flush=True)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:  # noqa: D102
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))


# ----------------------------------------------------------------------------- bf16 speed
# CPU flags that mean bf16 matmuls run in hardware (x86: AVX512-BF16, AMX; Arm: BF16 / SVE-BF16)
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16", "svebf16"})


@dataclass(frozen=True)
class Bf16Speed:
    """How fast bf16 runs on this machine's CPU, relative to fp32.

    Attributes:
        emulated: bf16 math is done in software here (slow); the demo then trains bf16 rows only for
            the steps its memory figures need.
        slowdown: measured time of a bf16 matmul / the same fp32 matmul (``nan`` when decided by flag).
        reason: one line saying how this was decided.
    """

    emulated: bool
    slowdown: float
    reason: str


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return flags


def matmul_slowdown(dtype: torch.dtype = torch.bfloat16, size: int = 256, repeats: int = 5) -> float:
    """Time of a ``size``-square matmul in ``dtype`` / in float32 (best of ``repeats``, after a warm-up).

    Runs on one thread: on a busy machine a multi-threaded fp32 matmul waits for its other thread and
    measures up to 50x slower, which would hide the gap this is meant to find.
    """

    def best(dt: torch.dtype) -> float:
        a, b = torch.randn(size, size).to(dt), torch.randn(size, size).to(dt)
        a @ b  # warm-up (kernel selection, caches)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return best(dtype) / max(best(torch.float32), 1e-9)
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=1)
def bf16_speed(threshold: float = 3.0) -> Bf16Speed:
    """Whether bf16 is emulated on this CPU: by CPU flag when one says "native", else by a timed probe.

    A bf16 matmul on a CPU without bf16 instructions (e.g. AVX2-only) measures tens of times slower than
    fp32; with AVX512-BF16 / AMX it is about as fast or faster. The probe (two 256x256 matmuls, a few
    milliseconds) calls bf16 emulated when it is more than ``threshold`` times slower than fp32: the gap
    is far wider than the noise of a busy machine. ``LOWMEM_BF16=native|emulated`` overrides both.

    Example::

        >>> speed = bf16_speed()
        >>> isinstance(speed.emulated, bool) and bool(speed.reason)
        True
    """
    forced = os.environ.get("LOWMEM_BF16", "").strip().lower()
    if forced in ("native", "emulated"):
        return Bf16Speed(forced == "emulated", float("nan"), f"LOWMEM_BF16={forced}")
    native = sorted(_NATIVE_BF16_FLAGS & _cpu_flags())
    if native:
        return Bf16Speed(False, float("nan"), f"CPU flag {native[0]}")
    slowdown = matmul_slowdown(torch.bfloat16)
    capability = torch.backends.cpu.get_cpu_capability()
    if slowdown > threshold:
        reason = (
            f"no bf16 instructions on this CPU ({capability}): a bf16 matmul measured {slowdown:.0f}x slower than fp32"
        )
        return Bf16Speed(True, slowdown, reason)
    return Bf16Speed(False, slowdown, f"bf16 matmul measured {slowdown:.1f}x the time of fp32 ({capability})")
