"""The quantization-aware training config: what :class:`~lightning_lowmem.callbacks.QuantizationAwareTraining`
and :func:`~lightning_lowmem.functional.quantization.prepare_qat_` take, validated once, where it is written.

Not torchao's ``QATConfig`` (``torchao.quantization.qat.QATConfig``, a prepare/convert step around a base
config): this one names the mode the weights are trained for and when, and builds torchao's at prepare time.

Example::

    >>> QATConfig("intx4_weight_only", start_step=100).quantization
    QuantizationConfig(mode='intx4_weight_only', group_size=32)
    >>> QATConfig("int8_dynamic")
    Traceback (most recent call last):
    ...
    ValueError: `mode`='int8_dynamic' is not a QAT mode; choose one of ['int8_weight_only', ...].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import nn

from lightning_lowmem.functional.config.constants import GROUP_SIZE, QAT_MODES
from lightning_lowmem.functional.config.techniques import QuantizationConfig

__all__ = ["QATConfig"]


def _as_given(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class QATConfig:
    """Quantization-aware training: fake-quantized weights from ``start_step``, real ones at convert.

    Args:
        mode: one of :data:`~lightning_lowmem.functional.config.QAT_MODES`. Default: ``"intx4_weight_only"``.
        start_step: global step from which the fake quantizers are on, an int >= 0. Default: 0.
        freeze_bn_step: global step from which BatchNorm statistics are frozen, or ``None``. Default: ``None``.
        convert_on_fit_end: convert to real quantized weights at the end of ``fit``. Default: ``True``.
        skip_modules: submodules kept in float (names, dotted suffixes, globs or class names; kept as a tuple).
            Default: ``()``.
        filter_fn: ``filter_fn(layer, fqn) -> bool`` chooses layers. Default: ``None``.
        group_size: group length of the int4 modes, an int >= 1. Default: ``GROUP_SIZE`` (32).

    Raises:
        ValueError: a mode QAT cannot train for, a bad ``group_size``, ``start_step`` / ``freeze_bn_step``.
        TypeError: ``skip_modules`` a string, ``convert_on_fit_end`` not a bool, ``filter_fn`` not callable.
    """

    mode: str = "intx4_weight_only"
    start_step: int = 0
    freeze_bn_step: int | None = None
    convert_on_fit_end: bool = True
    skip_modules: Sequence[str] = ()
    filter_fn: Callable[[nn.Module, str], bool] | None = None
    group_size: int = GROUP_SIZE

    def __post_init__(self) -> None:
        if self.mode not in QAT_MODES:
            raise ValueError(f"`mode`={self.mode!r} is not a QAT mode; choose one of {list(QAT_MODES)}.")
        QuantizationConfig(self.mode, self.group_size)  # the group size's one check
        if isinstance(self.start_step, bool) or not isinstance(self.start_step, int) or self.start_step < 0:
            raise ValueError(f"`start_step` must be an int >= 0, got {self.start_step!r}.")
        step = self.freeze_bn_step
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"`freeze_bn_step` must be None or an int >= 0, got {step!r}.")
        if not isinstance(self.convert_on_fit_end, bool):
            raise TypeError(f"`convert_on_fit_end` must be True or False, got {self.convert_on_fit_end!r}.")
        if isinstance(self.skip_modules, str):
            raise TypeError(f"`skip_modules` must be a list of module names, got the string {self.skip_modules!r}.")
        object.__setattr__(self, "skip_modules", tuple(self.skip_modules))
        if self.filter_fn is not None and not callable(self.filter_fn):
            raise TypeError(f"`filter_fn` must be None or a callable(layer, fqn) -> bool, got {self.filter_fn!r}.")

    @property
    def quantization(self) -> QuantizationConfig:
        """The weight quantization QAT trains for (and converts to)."""
        return QuantizationConfig(self.mode, self.group_size)

    @classmethod
    def of(cls, mode: Any, **kwargs: Any) -> QATConfig:
        """``mode`` itself when it is a ``QATConfig`` (no other argument may be given beside it), else
        ``QATConfig(mode, **kwargs)``: how the functional entry points take a config or its shorthand."""
        if not isinstance(mode, QATConfig):
            return cls(mode, **kwargs)
        defaults = {name: getattr(cls, name) for name in kwargs}
        given = sorted(name for name, value in kwargs.items() if _as_given(value) != defaults[name])
        if given:
            raise ValueError(f"`{'`, `'.join(given)}` given beside a QATConfig; set them in the config (one place)")
        return mode
