"""The distillation config: what :class:`~lightning_lowmem.distillation.DistillationModule` validates, once, where
it is written, and :func:`distillation_losses`, the objective it stands for on plain tensors (no Lightning).

``DistillationModule(...)`` builds one from its keyword arguments (so YAML configs are unchanged) and decides
*when* the losses are computed; :func:`distillation_losses` computes them: the logit loss (``"kd"`` in chunks
when the student's head is chunked, :mod:`~lightning_lowmem.distillation.chunked`) plus the weighted hint losses.

Example::

    >>> config = DistillationConfig(temperature=4.0, alpha=0.9, hint_layers={"body.2": "layers.5"})
    >>> config.hints, config.chunkable
    ({'body.2': 'layers.5'}, True)
    >>> DistillationConfig(alpha=1.5)
    Traceback (most recent call last):
    ...
    ValueError: `alpha` must be in [0, 1] (weight of the distillation term), got 1.5
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from lightning_lowmem.distillation.cache import check_cache_arguments
from lightning_lowmem.distillation.losses import call_loss, check_kd_arguments, feature_loss, get_loss
from lightning_lowmem.distillation.teacher import TEACHER_PRECISIONS
from lightning_lowmem.functional.cross_entropy.models import DeferredLogits

__all__ = ["DistillationConfig", "distillation_losses"]


@dataclass(frozen=True)
class DistillationConfig:
    """Knowledge distillation: the logit loss, its temperature and weight, the hint layers, the teacher's precision
    and cache.

    Args:
        loss: a logit loss registered with :func:`~lightning_lowmem.distillation.losses.register_loss`.
            Default: ``"kd"``.
        temperature: softening temperature ``T``, > 0. Default: 2.0.
        alpha: weight of the distillation term in [0, 1]; ``1 - alpha`` weighs the hard labels. Default: 0.5.
        hint_layers: student layer name -> teacher layer name (FitNets hints; kept as a tuple of pairs, read as
            :attr:`hints`). Default: ``None``.
        hint_weight: weight of the summed hint losses, >= 0. Default: 1.0.
        teacher_precision: ``"32"``, ``"bf16"`` or ``"int8"``. Default: ``"32"``.
        teacher_cache: path of a teacher-output cache, or ``None`` (live teacher). Default: ``None``.
        cache_top_k: keep the top-k teacher logits per position in the cache, or ``None``. Default: ``None``.
        cache_dtype: ``"float16"`` or ``"float32"`` on disk. Default: ``"float16"``.
        ignore_index: label value ignored by the losses and metrics. Default: -100.

    Raises:
        ValueError: an unknown ``loss`` / ``teacher_precision`` / ``cache_dtype``, a bad number, hints with a cache.
        TypeError: ``hint_layers`` not a mapping of names.
    """

    loss: str = "kd"
    temperature: float = 2.0
    alpha: float = 0.5
    hint_layers: Any = None
    hint_weight: float = 1.0
    teacher_precision: str = "32"
    teacher_cache: str | None = None
    cache_top_k: int | None = None
    cache_dtype: str = "float16"
    ignore_index: int = -100

    def __post_init__(self) -> None:
        get_loss(self.loss)  # an unknown name lists the registered ones
        for name in ("temperature", "alpha", "hint_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"`{name}` must be a number, got {type(value).__name__}: {value!r}")
        check_kd_arguments(self.temperature, self.alpha)
        if self.hint_weight < 0:
            raise ValueError(f"`hint_weight` must be >= 0 (the weight of the hint losses), got {self.hint_weight}")
        if self.teacher_precision not in TEACHER_PRECISIONS:
            raise ValueError(
                f"`teacher_precision`={self.teacher_precision!r} is unknown; choose from {list(TEACHER_PRECISIONS)}"
            )
        hints = self.hint_layers
        if isinstance(hints, Mapping):
            hints = tuple(hints.items())
        if hints is not None and not (
            isinstance(hints, tuple) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in hints)
        ):
            raise TypeError(f"`hint_layers` must map student layer names to teacher layer names, got {hints!r}")
        object.__setattr__(self, "hint_layers", hints or None)
        if self.hint_layers and self.teacher_cache is not None:
            raise ValueError("`hint_layers` need the live teacher's features; they cannot be used with `teacher_cache`")
        check_cache_arguments(self.cache_top_k, self.cache_dtype, prefix="cache_")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"`ignore_index` must be an int (a label value, e.g. -100), got {self.ignore_index!r}")

    @property
    def hints(self) -> dict[str, str]:
        """The hint layers, student name -> teacher name (empty without hints)."""
        return dict(self.hint_layers or ())

    @property
    def chunkable(self) -> bool:
        """The logit loss can be computed in chunks of positions (a student whose head is chunked needs it)."""
        return self.loss == "kd"


def distillation_losses(
    config: DistillationConfig,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor | None,
    *,
    mask: torch.Tensor | None = None,
    student_loss: torch.Tensor | None = None,
    student_features: Mapping[str, torch.Tensor] | None = None,
    teacher_features: Mapping[str, torch.Tensor] | None = None,
    adapters: Mapping[str, nn.Module] | None = None,
) -> dict[str, torch.Tensor]:
    """The losses of one distillation step: ``config.loss`` on the logits (``"kd"`` in chunks when
    ``student_logits`` are a chunked head's :class:`~lightning_lowmem.functional.cross_entropy.models.
    DeferredLogits`), plus ``config.hint_weight`` times the summed hint losses.

    Args:
        config: the :class:`DistillationConfig`.
        student_logits, teacher_logits: ``(B, C)`` or ``(B, T, V)``.
        targets: hard labels of the positions' shape, or ``None``.
        mask: positions that count, or ``None`` (all). Default: ``None``.
        student_loss: the student's own ``.loss``, the hard-label term when given. Default: ``None``.
        student_features, teacher_features: hint-layer outputs by layer name. Default: none.
        adapters: per student hint layer name, the module projecting its width to the teacher's. Default: none.

    Returns:
        ``{"loss": total, "logit_loss": ..., "hint_loss": ...}`` (``hint_loss`` only with hints).

    Example::

        >>> student, teacher = torch.zeros(2, 3), torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
        >>> losses = distillation_losses(DistillationConfig(alpha=1.0), student, teacher, None)
        >>> float(losses["loss"])
        0.0
    """
    kd = dict(temperature=config.temperature, alpha=config.alpha, ignore_index=config.ignore_index, mask=mask)
    if isinstance(student_logits, DeferredLogits):  # ChunkedCrossEntropy: the KD term in chunks
        if not config.chunkable:
            raise ValueError(
                f"`loss`={config.loss!r} needs the student's whole logits, which ChunkedCrossEntropy does not "
                "compute in training; use loss='kd' (computed in chunks) or drop ChunkedCrossEntropy"
            )
        from lightning_lowmem.distillation.chunked import chunked_kd_loss

        logit_loss = chunked_kd_loss(student_logits, teacher_logits, targets, hard_loss=student_loss, **kd)
    else:
        loss_fn = get_loss(config.loss)
        logit_loss = call_loss(loss_fn, student_logits, teacher_logits, targets, hard_loss=student_loss, **kd)
    losses = {"logit_loss": logit_loss, "loss": logit_loss}
    if config.hint_layers:
        student_features, teacher_features, adapters = student_features or {}, teacher_features or {}, adapters or {}
        hint = sum(
            feature_loss(student_features[student], teacher_features[teacher], adapters.get(student))
            for student, teacher in config.hint_layers
        )
        losses["hint_loss"] = hint
        losses["loss"] = logit_loss + config.hint_weight * hint
    return losses
