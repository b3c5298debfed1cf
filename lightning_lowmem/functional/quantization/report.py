"""What a quantization call did (:class:`QuantizationReport`), shared by post-training, static and QAT
quantization, the warning when a model stays mostly float, and the before/after table of
``PostTrainingQuantization`` (:func:`comparison_table`) with what it logs (:func:`logged_metrics`) and warns
when no mix of layers meets the tolerance (:func:`tolerance_failure_message`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from lightning_lowmem.memory.units import format_bytes
from lightning_lowmem.warnings import LowMemWarning

__all__ = [
    "MIN_CONVERTED_SHARE",
    "QuantizationReport",
    "comparison_table",
    "float_bytes_by_class",
    "logged_metrics",
    "tolerance_failure_message",
    "warn_if_mostly_float",
    "weight_bytes",
]

#: below this share of the parameter bytes converted, quantize_ warns (the model stays mostly float).
MIN_CONVERTED_SHARE = 0.5


@dataclass
class QuantizationReport:
    """What a quantization call did.

    Attributes:
        mode: the mode applied.
        bytes_before: parameter + buffer bytes of the module before.
        bytes_after: the same after (torchao tensors counted by their inner int data and scales).
        converted: fully-qualified names of the layers (Linear, Conv1D, Embedding) that were quantized.
        module: the quantized module (the same object for in-place modes; a new exported module
            for ``"int8_static"``).
        conv1d: the ``converted`` layers that were ``transformers`` ``Conv1D`` and are now ``nn.Linear``.
        tied: groups of ``converted`` layers sharing one weight, quantized once and still sharing it.
        converted_bytes: float bytes of the weights that were quantized (each tied weight once).
        notes: anything else the call decided (e.g. a reduced activation range for the CPU).
    """

    mode: str
    bytes_before: int
    bytes_after: int
    converted: list[str] = field(default_factory=list)
    module: nn.Module | None = field(default=None, repr=False)
    conv1d: list[str] = field(default_factory=list)
    tied: list[list[str]] = field(default_factory=list)
    converted_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def size_ratio(self) -> float:
        """``bytes_before / bytes_after`` (``1.0`` when nothing changed)."""
        return self.bytes_before / self.bytes_after if self.bytes_after else float("nan")

    @property
    def converted_share(self) -> float:
        """Share of the parameter bytes (before) that belonged to quantized weights."""
        return self.converted_bytes / self.bytes_before if self.bytes_before else 0.0

    def summary(self) -> str:
        """One line: what was converted and the size change."""
        parts = [f"{self.mode}: {len(self.converted)} layers quantized"]
        if self.conv1d:
            parts.append(f"{len(self.conv1d)} Conv1D -> nn.Linear")
        if self.tied:
            parts.append("tied, stored once: " + "; ".join(" = ".join(group) for group in self.tied))
        parts.append(
            f"{format_bytes(self.bytes_before)} -> {format_bytes(self.bytes_after)} ({self.size_ratio:.2f}x smaller, "
            f"{100 * self.converted_share:.0f}% of the bytes converted)"
        )
        return ", ".join(parts + self.notes)


def weight_bytes(module: nn.Module, names: Sequence[str]) -> int:
    """Bytes of the ``weight`` of the layers ``names`` of ``module``, each tied weight once."""
    weights = {id(w): w for w in (module.get_submodule(name).weight for name in names)}
    return sum(w.numel() * w.element_size() for w in weights.values())


def warn_if_mostly_float(module: nn.Module, report: QuantizationReport, stacklevel: int = 2) -> None:
    """Warn (``LowMemWarning``) when less than :data:`MIN_CONVERTED_SHARE` of the parameter bytes were
    quantized, naming the layer classes that hold the float rest."""
    if not report.converted or report.converted_share >= MIN_CONVERTED_SHARE:
        return
    listed = float_bytes_by_class(module)
    warnings.warn(
        f"quantize_(mode={report.mode!r}) converted {len(report.converted)} layers holding only "
        f"{100 * report.converted_share:.0f}% of {type(module).__name__}'s parameter bytes "
        f"({report.size_ratio:.2f}x smaller); float parameters remain in: {listed}. Only nn.Linear, transformers' "
        "Conv1D, nn.Embedding and (int8 modes) nn.Conv2d are quantized; check `skip_modules` / `filter_fn` / "
        "`embeddings` / `mode`.",
        LowMemWarning,
        stacklevel=stacklevel,
    )


def float_bytes_by_class(module: nn.Module, skip: Sequence[str] = ()) -> str:
    """The four layer classes holding the most float parameter bytes of ``module`` (layers ``skip`` left out),
    e.g. ``"Conv2d 72.00 KiB, BatchNorm2d 1.12 KiB"``."""
    skipped = {id(module.get_submodule(name)) for name in skip}
    by_class: dict[str, int] = {}
    seen: set[int] = set()
    for layer in module.modules():
        if id(layer) in skipped:
            continue
        for tensor in layer.parameters(recurse=False):
            if id(tensor) not in seen and type(tensor.data) in (torch.Tensor, nn.Parameter):
                seen.add(id(tensor))
                by_class[type(layer).__name__] = (
                    by_class.get(type(layer).__name__, 0) + tensor.numel() * tensor.element_size()
                )
    biggest = sorted(by_class.items(), key=lambda item: -item[1])[:4]
    return ", ".join(f"{name} {format_bytes(size)}" for name, size in biggest)


def comparison_table(mode: str, before: dict[str, Any], after: dict[str, Any] | None, kept: Sequence[str]) -> str:
    """The before/after table ``PostTrainingQuantization`` prints: size, latency per batch and metric of the
    float and quantized model (``after=None``: not applied), the layers kept in float, and a note when
    quantized runs slower. ``before``/``after`` hold ``bytes``, ``latency_s`` (``nan``: not timed) and
    optionally ``metric``.

    Example::

        >>> print(comparison_table("int8_dynamic", {"bytes": 4096, "latency_s": float("nan")},
        ...                        {"bytes": 1024, "latency_s": float("nan")}, []).splitlines()[2])
        float          4.00 KiB              -          -
    """
    rows = [f"PostTrainingQuantization ({mode})", f"{'':10} {'size':>12} {'latency/batch':>14} {'metric':>10}"]
    for label, figures in (("float", before), ("quantized", after)):
        if figures is None:
            rows.append(f"{label:10} {'(not applied: tolerance not met)':>38}")
            continue
        metric, latency = figures.get("metric"), figures["latency_s"]
        rows.append(
            f"{label:10} {format_bytes(figures['bytes']):>12} "
            f"{(f'{latency * 1e3:.3f} ms' if latency == latency else '-'):>14} "  # nan: not timed
            f"{(f'{metric:.4f}' if metric is not None else '-'):>10}"
        )
    rows.append(f"layers kept in float: {list(kept) or 'none'}")
    slower = after is not None and after["latency_s"] > before["latency_s"]  # nan compares False
    if slower:
        rows.append(
            f"note: quantized runs {after['latency_s'] / before['latency_s']:.1f}x SLOWER than float here: eager torchao "
            "int8 dispatches per op (smaller, not faster); on CPU use mode='int8_static' with compile=True for speed"
        )
    return "\n".join(rows)


def logged_metrics(
    before: dict[str, Any], after: dict[str, Any], kept: Sequence[str], report: QuantizationReport
) -> dict[str, float]:
    """What ``PostTrainingQuantization`` logs after quantizing: the size ratio (``before`` / ``after`` bytes),
    the number of layers kept in float and the share of the parameter bytes converted.

    Example::

        >>> report = QuantizationReport("int8_dynamic", 4096, 1024, converted_bytes=2048)
        >>> logged_metrics({"bytes": 4096}, {"bytes": 1024}, ["head"], report)
        {'lowmem/quantization/size_ratio': 4.0, 'lowmem/quantization/kept_float': 1.0, 'lowmem/quantization/converted_share': 0.5}
    """
    return {
        "lowmem/quantization/size_ratio": before["bytes"] / max(1, after["bytes"]),
        "lowmem/quantization/kept_float": float(len(kept)),
        "lowmem/quantization/converted_share": report.converted_share,
    }


def tolerance_failure_message(monitor: str, tolerance: float, baseline: float, sensitivity: dict[str, float]) -> str:
    """The warning when no configuration keeps ``monitor`` within ``tolerance`` of ``baseline``, listing each
    layer's drop (``sensitivity``, from :func:`~lightning_lowmem.functional.quantization.search.search_float_fallback`).

    Example::

        >>> tolerance_failure_message("val_acc", 0.01, 0.9, {"fc": 0.25})
        "PostTrainingQuantization: no configuration keeps 'val_acc' within tolerance 0.01 of 0.9 (per-layer drops: fc: 0.25); the model is left in float."
    """
    drops = ", ".join(f"{name}: {drop:.4g}" for name, drop in sensitivity.items())
    return (
        f"PostTrainingQuantization: no configuration keeps {monitor!r} within tolerance "
        f"{tolerance} of {baseline:.4g} (per-layer drops: {drops}); the model is left in float."
    )
