"""Quantize within a metric tolerance: the workflow ``PostTrainingQuantization(monitor=..., tolerance=...)`` runs,
as a function of a plain ``nn.Module`` and an ``evaluate(module) -> float`` callable (no Lightning).

All candidate layers are quantized if the metric allows; otherwise the layers whose quantization alone hurts
the metric most are kept in float one by one (:func:`~lightning_lowmem.functional.quantization.search.
search_float_fallback`), each mix evaluated with exactly its layers quantized and the float weights restored
after (:func:`~lightning_lowmem.functional.quantization.ptq.temporarily_quantized`). A tied group (token table
and head) is one candidate. If no mix meets the tolerance the model stays entirely float.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

from torch import nn

from lightning_lowmem.functional.config.techniques import QuantizationConfig
from lightning_lowmem.functional.quantization.ptq import quantizable_layers, quantize_, temporarily_quantized
from lightning_lowmem.functional.quantization.report import QuantizationReport
from lightning_lowmem.functional.quantization.search import expand_units, search_float_fallback, tied_units
from lightning_lowmem.warnings import NoEffectWarning

__all__ = ["ToleranceReport", "quantize_within_tolerance", "search_layers_within_tolerance"]


@dataclass
class ToleranceReport:
    """What :func:`quantize_within_tolerance` chose and measured.

    Attributes:
        met: some mix kept the metric within the tolerance (else the model stays float).
        baseline: the float model's metric.
        metric: the chosen mix's metric (``baseline`` when not met).
        quantized: the layers quantized (tied groups expanded; empty when not met).
        kept_float: the candidate layers kept in float (all of them when not met).
        sensitivity: per search unit (a layer, or a tied group's first layer), the metric drop when only it
            is quantized; empty when quantizing everything met the tolerance at once.
        tried: ``(number of units kept in float, metric)`` for every mix evaluated.
        report: the :class:`QuantizationReport` of the conversion, ``None`` when not met.
    """

    met: bool
    baseline: float
    metric: float
    quantized: list[str]
    kept_float: list[str]
    sensitivity: dict[str, float] = field(default_factory=dict)
    tried: list[tuple[int, float]] = field(default_factory=list)
    report: QuantizationReport | None = None


def search_layers_within_tolerance(
    module: nn.Module,
    candidates: Sequence[str],
    evaluate_layers: Callable[[Sequence[str]], float],
    tolerance: float,
    *,
    higher_is_better: bool = True,
) -> ToleranceReport:
    """The search alone: ``evaluate_layers(names)`` is the metric with exactly ``names`` quantized (how is the
    caller's: ``int8_static`` evaluates a calibrated graph). Tied groups of ``module`` are one candidate.
    Nothing is converted (``report`` is ``None``)."""
    units = tied_units(module, candidates)
    result = search_float_fallback(
        list(units),
        lambda names: evaluate_layers(expand_units(units, names)),
        tolerance=tolerance,
        higher_is_better=higher_is_better,
    )
    quantized = expand_units(units, result.quantized)
    kept = [name for name in candidates if name not in quantized]
    met, sensitivity, tried = result.met, result.sensitivity, result.tried
    return ToleranceReport(met, result.baseline, result.metric, quantized, kept, sensitivity, tried)


def quantize_within_tolerance(
    module: nn.Module,
    config: QuantizationConfig | str,
    evaluate: Callable[[nn.Module], float],
    tolerance: float,
    *,
    higher_is_better: bool = True,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    skip_modules: Sequence[str] = (),
    embeddings: bool | None = None,
) -> ToleranceReport:
    """Quantize as many layers of ``module`` as keep ``evaluate(module)`` within ``tolerance`` of the float
    model's, in place.

    Args:
        module: the float model (a plain ``nn.Module``).
        config: a :class:`~lightning_lowmem.functional.config.QuantizationConfig` with an in-place mode (not
            ``"int8_static"``), or a mode name (shorthand).
        evaluate: the metric of ``module`` as it is when called (e.g. accuracy on a held-out set). Called
            once for the float model, once with every candidate quantized and, if that drops too much, once
            per candidate and once per mix tried.
        tolerance: the largest allowed drop of the metric, >= 0, in its units.
        higher_is_better: ``False`` for a loss or a perplexity. Default: ``True``.
        filter_fn, skip_modules, embeddings: which layers are candidates, as in
            :func:`~lightning_lowmem.functional.quantization.quantize_`. Defaults: ``None``, ``()``, ``None``.

    Returns:
        A :class:`ToleranceReport`; ``module`` holds its quantized layers when ``met``, else is unchanged.

    Raises:
        ValueError: a negative ``tolerance``, ``"int8_static"`` (calibrated: ``PostTrainingQuantization``
            runs its search), and the config's checks.

    Warns:
        NoEffectWarning: no layer is a candidate (nothing evaluated, nothing quantized).

    Example::

        >>> import torch
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        >>> inputs = torch.randn(32, 64)
        >>> reference = model(inputs).detach()
        >>> def error(m):
        ...     with torch.no_grad():
        ...         return float((m(inputs) - reference).abs().max())
        >>> outcome = quantize_within_tolerance(model, "int8_weight_only", error, 0.1, higher_is_better=False)
        >>> outcome.met, outcome.quantized, outcome.baseline
        (True, ['0', '2'], 0.0)
    """
    config = QuantizationConfig.of(config)
    mode = config.mode_name("quantize_within_tolerance")
    if mode == "int8_static":
        raise ValueError(
            "`mode`='int8_static' is calibrated on batches: quantize_within_tolerance takes the in-place modes; "
            "PostTrainingQuantization(mode='int8_static', monitor=..., tolerance=...) runs its search"
        )
    candidates = quantizable_layers(
        module, config, filter_fn=filter_fn, skip_modules=skip_modules, embeddings=embeddings
    )
    if not candidates:
        warnings.warn(
            f"quantize_within_tolerance(mode={mode!r}) found no quantizable layer in {type(module).__name__}: "
            "nothing was evaluated or quantized.",
            NoEffectWarning,
            stacklevel=2,
        )
        return ToleranceReport(False, float("nan"), float("nan"), [], [])

    def evaluate_layers(names: Sequence[str]) -> float:
        with temporarily_quantized(module, mode, names, group_size=config.group_size):
            return float(evaluate(module))

    outcome = search_layers_within_tolerance(
        module, candidates, evaluate_layers, tolerance, higher_is_better=higher_is_better
    )
    if outcome.met:
        chosen = set(outcome.quantized)
        outcome.report = quantize_(module, config, filter_fn=lambda _, fqn: fqn in chosen, embeddings=embeddings)
    return outcome
