"""The bookkeeping around an adapter run, pure (no Lightning): base weights read from a file, the counts a
run logs, and what a checkpoint records of the adapter settings (and how a different setting is reported
when one is loaded). Dropping frozen parameters from optimizers is generic: ``optimizers.convert.drop_frozen_``."""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
from torch import nn

from lightning_lowmem.functional.lora.adapters import ADAPTER_SUFFIXES, RUNNING_STAT_SUFFIXES, LoraReport

__all__ = [
    "adapter_entries",
    "check_same_settings",
    "check_weights_path",
    "checkpoint_record",
    "load_base_weights_",
    "parameter_metrics",
    "settings_conflict",
    "wrap_summary",
]

#: settings a checkpoint's adapters must share with the run that loads them
SETTINGS = ("r", "alpha", "quantize_base")
_DEFAULTS = {"alpha": 16.0, "quantize_base": None}


def check_weights_path(name: str, path: Any) -> None:
    """Raise ``ValueError`` unless ``path`` (the argument ``name``) is a file path or ``None``.

    Example::

        >>> check_weights_path("merged_weights_path", 3)
        Traceback (most recent call last):
        ...
        ValueError: `merged_weights_path` must be a file path or None, got int: 3
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"`{name}` must be a file path or None, got {type(path).__name__}: {path!r}")


def load_base_weights_(module: nn.Module, path: str | os.PathLike) -> None:
    """Load pretrained weights into ``module`` with ``strict=True`` from ``path``: a Lightning checkpoint
    (its ``state_dict``) or a plain state dict.

    Raises:
        FileNotFoundError: ``path`` is not a file.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"`base_weights_path`={path!r} is not a file")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    module.load_state_dict(payload.get("state_dict", payload), strict=True)


def wrap_summary(report: LoraReport) -> str:
    """One line: the layers wrapped, the settings, and the trainable share.

    Example::

        >>> wrap_summary(LoraReport(["fc"], r=4, alpha=8.0, quantize_base="int8", trainable_params=40, total_params=1000))
        'LowRankAdapters: 1 layers wrapped (r=4, alpha=8, base int8); trainable parameters 40 of 1,000 (4.00%)'
    """
    return (
        f"LowRankAdapters: {len(report.wrapped)} layers wrapped (r={report.r}, alpha={report.alpha:g}"
        f"{', base ' + report.quantize_base if report.quantize_base else ''})"
        f"{'; trained in full: ' + ', '.join(report.trained) if report.trained else ''}; trainable parameters "
        f"{report.trainable_params:,} of {report.total_params:,} "
        f"({100 * report.trainable_fraction:.2f}%)"
    )


def parameter_metrics(module: nn.Module, prefix: str = "lowmem/lora") -> dict[str, float]:
    """``<prefix>/trainable_params``, ``<prefix>/total_params`` and ``<prefix>/trainable_fraction`` of ``module``."""
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.parameters())
    return {
        f"{prefix}/trainable_params": float(trainable),
        f"{prefix}/total_params": float(total),
        f"{prefix}/trainable_fraction": trainable / max(total, 1),
    }


def checkpoint_record(
    settings: dict[str, Any], target: Any, *, save_base_weights: bool, version: int
) -> dict[str, Any]:
    """What a checkpoint records of an adapter run (besides its writer): the format, the ``settings``
    (``r``, ``alpha``, ``quantize_base``), the ``target`` layers, and the callback that loads it (``needs``).

    Example::

        >>> checkpoint_record({"r": 4, "alpha": 16.0, "quantize_base": None}, ["fc"], save_base_weights=False, version=1)["needs"]
        'callbacks=[LowRankAdapters(r=4)] (same target layers)'
    """
    arguments = ", ".join(f"{k}={v!r}" for k, v in settings.items() if k not in _DEFAULTS or v != _DEFAULTS[k])
    return {
        "format": "full" if save_base_weights else "adapters-only",
        "version": version,
        "needs": f"callbacks=[LowRankAdapters({arguments})] (same target layers)",
        "target": list(target) if isinstance(target, (list, tuple)) else str(target),
        **settings,
    }


def adapter_entries(state_dict: dict[str, Any], trained: Sequence[str] = ()) -> dict[str, Any]:
    """The adapter tensors of a state dict (keys ending in ``.lora_A`` / ``.lora_B``), those of the modules
    ``trained`` in full beside them, and the running statistics of normalisation layers (BatchNorm's)."""
    prefixes = tuple(f"{name}." for name in trained)
    kept = ADAPTER_SUFFIXES + RUNNING_STAT_SUFFIXES
    return {k: v for k, v in state_dict.items() if k.endswith(kept) or (prefixes and k.startswith(prefixes))}


def settings_conflict(entry: dict[str, Any], settings: dict[str, Any], version: int) -> str | None:
    """Why a checkpoint's adapter record ``entry`` cannot load into a run with ``settings`` (``None``: it can).

    Example::

        >>> settings_conflict({"r": 8, "needs": "r=8"}, {"r": 4, "alpha": 16.0}, version=1)
        "its adapters have r=8 but this Trainer's LowRankAdapters has r=4; use r=8."
    """
    if entry.get("version", 1) > version:
        return f"a newer lightning_lowmem wrote it (version {entry.get('version')}); upgrade lightning_lowmem."
    different = {k: v for k, v in settings.items() if k in entry and entry[k] != v}
    if different:
        saved = ", ".join(f"{k}={entry[k]!r}" for k in different)
        mine = ", ".join(f"{k}={v!r}" for k, v in different.items())
        return f"its adapters have {saved} but this Trainer's LowRankAdapters has {mine}; use {entry.get('needs')}."
    return None


def check_same_settings(saved: dict[str, Any], settings: dict[str, Any]) -> None:
    """Raise ``ValueError`` when a resumed run's adapter ``settings`` differ from the ``saved`` ones."""
    for name in SETTINGS:
        if name in saved and saved[name] != settings[name]:
            raise ValueError(
                f"checkpoint adapters were trained with {name}={saved[name]!r} but this LowRankAdapters has "
                f"{name}={settings[name]!r}; use the same settings to resume."
            )
