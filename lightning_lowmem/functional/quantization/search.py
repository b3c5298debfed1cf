"""Latency and the accuracy-aware float fallback that ``PostTrainingQuantization(tolerance=...)`` runs.

Nothing here quantizes: :func:`search_float_fallback` only decides which layers to quantize from the
metric an ``evaluate`` callback reports, so it works for any quantization mode (and is unit-tested on
plain numbers); :func:`tied_units` makes a tied group one candidate of that search, and
:func:`size_and_latency` gives the before/after figures. Re-exported from
:mod:`lightning_lowmem.functional.quantization.ptq`.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_lowmem.functional.quantization.layers import tied_groups
from lightning_lowmem.memory.measure import state_bytes
from lightning_lowmem.model_io import forward_batch

__all__ = [
    "ToleranceSearchResult",
    "expand_units",
    "measure_latency",
    "search_float_fallback",
    "size_and_latency",
    "tied_units",
]


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


def tied_units(module: nn.Module, candidates: Sequence[str]) -> dict[str, list[str]]:
    """Search unit (first layer of a tied group, or the layer) -> the candidate layers it stands for: a tied
    group is quantized (or kept float) as one.

    Example::

        >>> model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False), nn.Linear(8, 2))
        >>> model[1].weight = model[0].weight
        >>> tied_units(model, ["0", "1", "2"])
        {'0': ['0', '1'], '2': ['2']}
    """
    group_of = {name: group for group in tied_groups(module) for name in group}
    units: dict[str, list[str]] = {}
    seen: set[str] = set()
    for name in candidates:
        if name not in seen:
            units[name] = [n for n in group_of.get(name, [name]) if n in candidates]
            seen.update(units[name])
    return units


def expand_units(units: dict[str, list[str]], chosen: Sequence[str]) -> list[str]:
    """The layers the search units ``chosen`` stand for (see :func:`tied_units`)."""
    return [name for unit in chosen for name in units[unit]]


def size_and_latency(module: nn.Module, batch: Any = None, *, repeats: int = 10, warmup: int = 2) -> dict[str, Any]:
    """``{"bytes": parameter bytes, "latency_s": median seconds per batch}`` of ``module``, run in eval mode
    on ``batch`` (on its device) the way the package always calls it
    (:func:`~lightning_lowmem.model_io.forward_batch`); no ``batch``: latency is ``nan`` (not timed).

    Raises:
        BatchCallError: the model cannot be called on ``batch`` (names the override point).
    """
    figures: dict[str, Any] = {"bytes": state_bytes(module)["parameters"], "latency_s": float("nan")}
    if batch is None:
        return figures
    was_training = module.training
    module.eval()
    try:
        run = functools.partial(forward_batch, module)
        figures["latency_s"] = measure_latency(run, (batch,), repeats=repeats, warmup=warmup)
    finally:
        module.train(was_training)
    return figures
