"""Latency and the accuracy-aware float fallback that ``PostTrainingQuantization(tolerance=...)`` runs.

Nothing here quantizes: :func:`search_float_fallback` only decides which layers to quantize from the
metric an ``evaluate`` callback reports, so it works for any quantization mode (and is unit-tested on
plain numbers). Re-exported from :mod:`lightning_lowmem.functional.quantization.ptq`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

__all__ = ["ToleranceSearchResult", "measure_latency", "search_float_fallback"]


@torch.inference_mode()
def measure_latency(module: nn.Module, inputs: tuple[Any, ...], *, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time (seconds) of ``module(*inputs)`` under ``torch.inference_mode``."""
    times = []
    for index in range(warmup + repeats):
        start = time.perf_counter()
        module(*inputs)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class ToleranceSearchResult:
    """Outcome of :func:`search_float_fallback`.

    Attributes:
        met: whether some configuration kept the metric within tolerance.
        baseline: the float model's metric.
        metric: the chosen configuration's metric (``baseline`` when none was met).
        quantized: layers to quantize (empty when not met).
        kept_float: candidate layers kept in float (all of them when not met).
        sensitivity: per layer, the metric drop when only that layer is quantized.
        tried: ``(number of layers kept in float, metric)`` for every configuration evaluated.
    """

    met: bool
    baseline: float
    metric: float
    quantized: list[str]
    kept_float: list[str]
    sensitivity: dict[str, float]
    tried: list[tuple[int, float]]


def search_float_fallback(
    candidates: Sequence[str],
    evaluate: Callable[[Sequence[str]], float],
    *,
    tolerance: float,
    higher_is_better: bool = True,
) -> ToleranceSearchResult:
    """Quantize as many of ``candidates`` as possible while the metric drop stays within ``tolerance``.

    ``evaluate(quantized_names)`` returns the metric of the model with exactly those layers quantized
    (``evaluate([])`` is the float model). All layers are tried first; if the drop is too large, each
    layer's sensitivity (drop when quantized alone) is measured and the most sensitive layers are kept
    in float one by one, until the drop fits or only float would remain (then ``met`` is False).
    """
    if tolerance < 0:
        raise ValueError(f"`tolerance` must be >= 0, got {tolerance!r}.")
    sign = 1.0 if higher_is_better else -1.0

    def drop(metric: float) -> float:
        return sign * (baseline - metric)

    candidates = list(candidates)
    baseline = float(evaluate([]))
    tried: list[tuple[int, float]] = []
    metric = float(evaluate(candidates))
    tried.append((0, metric))
    if drop(metric) <= tolerance:
        return ToleranceSearchResult(True, baseline, metric, candidates, [], {}, tried)
    sensitivity = {name: drop(float(evaluate([name]))) for name in candidates}
    by_sensitivity = sorted(candidates, key=lambda name: sensitivity[name], reverse=True)
    for kept in range(1, len(candidates)):
        kept_float = by_sensitivity[:kept]
        quantized = [name for name in candidates if name not in kept_float]
        metric = float(evaluate(quantized))
        tried.append((kept, metric))
        if drop(metric) <= tolerance:
            return ToleranceSearchResult(True, baseline, metric, quantized, kept_float, sensitivity, tried)
    return ToleranceSearchResult(False, baseline, baseline, [], candidates, sensitivity, tried)
