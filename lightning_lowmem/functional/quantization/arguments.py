"""Checks of ``PostTrainingQuantization``'s argument combinations, pure (no model, no Trainer), and of a
submodule name against a model: the errors name the argument, the value received and what is allowed."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from lightning_lowmem.functional.config.constants import GROUP_SIZE
from lightning_lowmem.functional.config.techniques import QuantizationConfig
from lightning_lowmem.functional.quantization.modes import include_embeddings

__all__ = ["check_ptq_arguments", "check_submodule"]


def check_ptq_arguments(
    mode: str,
    *,
    skip_modules: Sequence[str] = (),
    embeddings: bool | None = None,
    monitor: str | None = None,
    tolerance: float | None = None,
    monitor_mode: str = "max",
    module_name: str | None = None,
    calibration_batches: int = 8,
    compile: bool = False,
    group_size: int = GROUP_SIZE,
) -> QuantizationConfig:
    """Raise if the post-training quantization arguments do not go together (same names and defaults as
    :class:`~lightning_lowmem.callbacks.PostTrainingQuantization`). The mode and the group size are checked
    by the :class:`~lightning_lowmem.functional.config.QuantizationConfig` it builds, their one place.

    Returns:
        The :class:`~lightning_lowmem.functional.config.QuantizationConfig` of ``mode`` and ``group_size``.

    Raises:
        ValueError: unknown ``mode`` / ``monitor_mode``, a bad ``group_size``, ``tolerance`` without ``monitor`` or < 0,
            ``calibration_batches`` not an int > 0, ``int8_static`` without ``module_name`` or with
            ``embeddings=True``, ``module_name`` / ``compile`` with another mode.
        TypeError: ``skip_modules`` is a string, ``embeddings`` not a bool or ``None``.

    Example::

        >>> check_ptq_arguments("int8_dynamic", monitor="val_acc", tolerance=0.01)
        QuantizationConfig(mode='int8_dynamic', group_size=32)
        >>> check_ptq_arguments("int8_static")
        Traceback (most recent call last):
        ...
        ValueError: `mode`='int8_static' needs `module_name`: ...
    """
    config = QuantizationConfig(mode, group_size)
    config.mode_name("PostTrainingQuantization")
    if mode == "int8_static" and not module_name:
        raise ValueError(
            "`mode`='int8_static' needs `module_name`: the submodule (e.g. 'model') to replace by its exported "
            "int8 graph, since a LightningModule itself cannot be replaced."
        )
    if mode != "int8_static" and (module_name is not None or compile):
        raise ValueError(
            f"`module_name`={module_name!r} / `compile`={compile!r} apply to mode='int8_static' only, got "
            f"mode={mode!r}; to compile a torchao-quantized model use "
            "lightning_lowmem.functional.quantization.compile.compile_inference(model)."
        )
    if not isinstance(calibration_batches, int) or calibration_batches <= 0:
        raise ValueError(f"`calibration_batches` must be an int > 0, got {calibration_batches!r}.")
    if tolerance is not None and monitor is None:
        raise ValueError(f"`tolerance`={tolerance!r} needs `monitor` (the logged metric to keep within it).")
    if tolerance is not None and (not isinstance(tolerance, (int, float)) or tolerance < 0):
        raise ValueError(f"`tolerance` must be a number >= 0, got {tolerance!r}.")
    if monitor_mode not in ("max", "min"):
        raise ValueError(f"`monitor_mode`={monitor_mode!r} must be 'max' or 'min'.")
    if isinstance(skip_modules, str):
        raise TypeError(f"`skip_modules` must be a list of module names, got the string {skip_modules!r}.")
    include_embeddings(mode, embeddings)  # validates it
    return config


def check_submodule(module: nn.Module, module_name: str) -> nn.Module:
    """``module.get_submodule(module_name)``, or a ``ValueError`` listing ``module``'s children.

    Example::

        >>> check_submodule(nn.Sequential(nn.Linear(2, 2)), "0")
        Linear(in_features=2, out_features=2, bias=True)
    """
    try:
        return module.get_submodule(module_name)
    except AttributeError:
        children = [name for name, _ in module.named_children()]
        raise ValueError(
            f"`module_name`={module_name!r} is not a submodule of {type(module).__name__}; its children are {children}."
        ) from None
