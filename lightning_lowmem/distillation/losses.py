"""Distillation losses (pure functions on tensors) and the hint-layer helpers they need.

No Lightning import: everything here works on plain tensors and ``nn.Module`` objects.

* :func:`kd_loss` — Hinton et al. (2015): ``alpha * T² * KL(p_teacher^T || p_student^T) + (1 - alpha) * CE``.
* :func:`soft_cross_entropy` — cross-entropy against a probability distribution.
* :func:`feature_loss` — FitNets (Romero et al., 2015) hint loss: MSE between (projected) features.
* :class:`FeatureRecorder` — forward hooks that capture named intermediate outputs.
* :func:`make_adapter` — a learned projection when student and teacher widths differ.
* :func:`register_loss` / :func:`get_loss` — name custom logit losses so YAML configs can pick them.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FeatureRecorder",
    "call_loss",
    "check_logit_shapes",
    "feature_loss",
    "find_module",
    "get_loss",
    "kd_loss",
    "layer_width",
    "make_adapter",
    "register_loss",
    "soft_cross_entropy",
]


def check_logit_shapes(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    """Raise when student and teacher logits cannot be compared position by position.

    Both must have the same shape, e.g. ``(B, C)`` for classification or ``(B, T, V)`` for sequences.

    Raises:
        ValueError: the shapes differ; the message names both.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student output shape {tuple(student_logits.shape)} cannot be matched to teacher output shape "
            f"{tuple(teacher_logits.shape)}: distillation compares them position by position, so both must "
            "have the same number of classes / vocabulary size and the same sequence length."
        )


def _flatten_logits(logits: torch.Tensor) -> torch.Tensor:
    # (B, C) stays, (B, T, V) -> (B*T, V)
    return logits.reshape(-1, logits.size(-1))


def soft_cross_entropy(
    student_logits: torch.Tensor, teacher_probs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over positions of ``-sum(teacher_probs * log_softmax(student_logits))``.

    Args:
        student_logits: ``(..., C)`` raw scores.
        teacher_probs: ``(..., C)`` probabilities (rows sum to 1).
        mask: optional ``(...)`` bool tensor of positions that count. Default: all.

    Returns:
        A scalar tensor.
    """
    per_position = -(teacher_probs * F.log_softmax(student_logits, dim=-1)).sum(-1)
    if mask is not None:
        return per_position[mask].mean()
    return per_position.mean()


def check_kd_arguments(temperature: float, alpha: float) -> None:
    """Raise ``ValueError`` for a temperature <= 0 or an ``alpha`` outside [0, 1]."""
    if temperature <= 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"`alpha` must be in [0, 1] (weight of the distillation term), got {alpha}")


def kl_per_position(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """``KL(softmax(teacher / T) || softmax(student / T))`` of each ``(N, C)`` row, ``(N,)``."""
    log_p_student = F.log_softmax(student / temperature, dim=-1)
    log_p_teacher = F.log_softmax(teacher / temperature, dim=-1)
    p_teacher = log_p_teacher.exp()
    # classes a top-k cache left out have p_teacher == 0 (logit -inf): they add nothing, not NaN
    return torch.where(p_teacher > 0, p_teacher * (log_p_teacher - log_p_student), 0.0).sum(-1)


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor | None = None,
    temperature: float = 2.0,
    alpha: float = 0.5,
    ignore_index: int = -100,
    *,
    mask: torch.Tensor | None = None,
    hard_loss: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hinton knowledge-distillation loss.

    ``alpha * T² * KL(softmax(teacher/T) || softmax(student/T)) + (1 - alpha) * CE(student, targets)``,
    the KL averaged over the positions that count (classification rows, or the tokens of a ``(B, T, V)``
    sequence that are neither padding nor ignored). The ``T²`` factor keeps the soft term's gradient scale
    independent of ``T``. With ``alpha=1`` and ``T=1`` its gradient equals that of plain cross-entropy
    against the teacher's probabilities.

    Args:
        student_logits: ``(B, C)`` or ``(B, T, V)``.
        teacher_logits: same shape as ``student_logits`` (no gradient needed).
        targets: hard labels ``(B,)`` or ``(B, T)``; required when ``alpha < 1`` and no ``hard_loss``.
            Default: ``None``.
        temperature: softening temperature ``T`` > 0. Default: 2.0.
        alpha: weight of the distillation term in [0, 1]; ``1 - alpha`` weighs the hard-label loss.
            Default: 0.5.
        ignore_index: target value whose positions are left out of both terms. Default: -100.
        mask: ``bool`` tensor of the positions' shape (``logits.shape[:-1]``): only ``True`` positions count in
            both terms, e.g. ``attention_mask`` of a padded batch. Logits at other positions do not change the
            loss. Default: ``None`` (every position whose target is not ``ignore_index``).
        hard_loss: the hard-label term, already computed, used instead of ``CE(student, targets)``, e.g. a
            Hugging Face model's own ``.loss`` (shifted for causal LMs). Default: ``None``.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: shapes that cannot be matched, ``temperature`` <= 0, ``alpha`` outside [0, 1], or
            ``targets`` missing while ``alpha < 1`` and no ``hard_loss``.

    Example::

        >>> student, teacher = torch.zeros(2, 3), torch.zeros(2, 3)
        >>> float(kd_loss(student, teacher, alpha=1.0))
        0.0
    """
    check_kd_arguments(temperature, alpha)
    check_logit_shapes(student_logits, teacher_logits)
    student = _flatten_logits(student_logits)  # (N, C)
    teacher = _flatten_logits(teacher_logits).to(student.dtype)  # (N, C)
    keep = None
    if mask is not None:
        if mask.shape != student_logits.shape[:-1]:
            raise ValueError(
                f"`mask` shape {tuple(mask.shape)} does not match the positions {tuple(student_logits.shape[:-1])} "
                f"of logits {tuple(student_logits.shape)}"
            )
        keep = mask.reshape(-1).to(torch.bool)  # (N,)
    if targets is not None:
        flat_targets = targets.reshape(-1)
        if flat_targets.numel() != student.size(0):
            raise ValueError(
                f"`targets` shape {tuple(targets.shape)} does not match logits shape {tuple(student_logits.shape)}"
            )
        keep = flat_targets != ignore_index if keep is None else keep & (flat_targets != ignore_index)
    if keep is not None and bool(keep.all()):
        keep = None
    loss = student.new_zeros(())
    if alpha > 0:
        kl = kl_per_position(student, teacher, temperature)  # (N,)
        if keep is not None:  # padded / ignored positions are selected away: their logits do not matter
            kl = kl[keep] if bool(keep.any()) else kl[keep].sum()  # no position counts: 0, not NaN
        loss = loss + alpha * temperature**2 * kl.mean()
    if alpha < 1:
        if hard_loss is not None:
            loss = loss + (1 - alpha) * hard_loss
        elif targets is None:
            raise ValueError(f"`targets` are required for the hard-label term when `alpha`={alpha} < 1")
        else:
            flat_targets = targets.reshape(-1)
            if keep is not None:
                flat_targets = torch.where(keep, flat_targets, ignore_index)
            loss = loss + (1 - alpha) * F.cross_entropy(student, flat_targets, ignore_index=ignore_index)
    return loss


def feature_loss(
    student_features: torch.Tensor, teacher_features: torch.Tensor, adapter: nn.Module | None = None
) -> torch.Tensor:
    """FitNets hint loss: MSE between ``adapter(student_features)`` and ``teacher_features``.

    Args:
        student_features: an intermediate student output, e.g. ``(B, H_s)`` or ``(B, C_s, H, W)``.
        teacher_features: the matching teacher output, e.g. ``(B, H_t)`` or ``(B, C_t, H, W)``.
        adapter: learned projection from the student width to the teacher width (see
            :func:`make_adapter`). Default: ``None`` (widths already equal).

    Returns:
        A scalar tensor.

    Raises:
        ValueError: the projected student features and the teacher features differ in shape.
    """
    projected = adapter(student_features) if adapter is not None else student_features
    teacher = teacher_features.to(projected.dtype)
    if projected.shape != teacher.shape:
        raise ValueError(
            f"hint features cannot be matched: student {tuple(student_features.shape)} (projected to "
            f"{tuple(projected.shape)}) vs teacher {tuple(teacher_features.shape)}"
        )
    return F.mse_loss(projected, teacher)


def find_module(model: nn.Module, name: str, role: str = "model") -> nn.Module:
    """``model.get_submodule(name)`` with an error that lists the closest existing names.

    Raises:
        ValueError: no submodule called ``name``.
    """
    names = [n for n, _ in model.named_modules() if n]
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.4) or names[:10]
        raise ValueError(f"hint layer {name!r} does not exist in the {role}; close names: {close}")
    return model.get_submodule(name)


def layer_width(layer: nn.Module) -> tuple[int, int]:
    """``(width, dim)`` of a layer's output: its feature count and the dim that holds it (-1 or 1).

    Raises:
        ValueError: the width cannot be read from the layer's attributes.
    """
    for attribute in ("out_features", "embedding_dim", "nf"):  # nf: Hugging Face Conv1D (GPT-2)
        if hasattr(layer, attribute):
            return int(getattr(layer, attribute)), -1
    if hasattr(layer, "out_channels"):
        return int(layer.out_channels), 1
    if isinstance(layer, nn.LayerNorm):
        return int(layer.normalized_shape[-1]), -1
    if isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d)):
        return int(layer.num_features), 1
    raise ValueError(
        f"cannot read the output width of a {type(layer).__name__}: use a Linear / Conv / Embedding / "
        "LayerNorm / BatchNorm layer as a hint layer"
    )


class _ChannelLinear(nn.Module):
    """1x1 convolution as a projection on dim 1 of ``(B, C, ...)`` features."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_channels, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.movedim(1, -1)).movedim(-1, 1)  # (B, C_s, ...) -> (B, C_t, ...)


def make_adapter(student_layer: nn.Module, teacher_layer: nn.Module) -> nn.Module:
    """A learned projection from the student layer's output width to the teacher layer's.

    Returns ``nn.Identity()`` when the widths already match.

    Example::

        >>> make_adapter(nn.Linear(4, 8), nn.Linear(4, 32))
        Linear(in_features=8, out_features=32, bias=True)
    """
    student_width, student_dim = layer_width(student_layer)
    teacher_width, teacher_dim = layer_width(teacher_layer)
    if student_dim != teacher_dim:
        raise ValueError(
            f"hint layers hold features on different dims: student {type(student_layer).__name__} (dim "
            f"{student_dim}) vs teacher {type(teacher_layer).__name__} (dim {teacher_dim})"
        )
    if student_width == teacher_width:
        return nn.Identity()
    if student_dim == -1:
        return nn.Linear(student_width, teacher_width)
    return _ChannelLinear(student_width, teacher_width)


class FeatureRecorder:
    """Forward hooks that keep the latest output of named submodules.

    Use as a context manager or call :meth:`remove`; every hook handle is released.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        >>> with FeatureRecorder(model, ["0"]) as recorder:
        ...     _ = model(torch.zeros(2, 4))
        ...     print(tuple(recorder.features["0"].shape))
        (2, 8)
    """

    def __init__(self, model: nn.Module, names: list[str], role: str = "model") -> None:
        self.features: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []
        for name in names:
            layer = find_module(model, name, role)
            self._handles.append(layer.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            self.features[name] = output[0] if isinstance(output, (tuple, list)) else output

        return record

    def clear(self) -> None:
        self.features.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.features.clear()

    def __enter__(self) -> FeatureRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


LossFn = Callable[..., torch.Tensor]
_LOSSES: dict[str, LossFn] = {"kd": kd_loss}


def register_loss(name: str, fn: LossFn) -> None:
    """Register a logit loss under ``name`` so ``DistillationModule(loss=name)`` (and YAML) can use it.

    ``fn(student_logits, teacher_logits, targets, temperature=..., alpha=..., ignore_index=...)`` returns a
    scalar. If ``fn`` also accepts ``mask=`` (positions that count: padding excluded) and ``hard_loss=`` (the
    student's own ``.loss``, e.g. of a Hugging Face model given ``labels``), it receives them, as :func:`kd_loss` does.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be callable, got {type(fn).__name__}")
    _LOSSES[name] = fn


def get_loss(name: str) -> LossFn:
    """The loss registered under ``name``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if name not in _LOSSES:
        raise ValueError(f"`loss`={name!r} is not registered; choose from {sorted(_LOSSES)} or call register_loss()")
    return _LOSSES[name]


def call_loss(fn: LossFn, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``fn(*args, **kwargs)`` leaving out the ``None`` keywords and those ``fn`` does not accept, so a loss
    registered before ``mask`` / ``hard_loss`` existed keeps working (with tuple batches, which need neither)."""
    kwargs = {key: value for key, value in kwargs.items() if value is not None or key in ("temperature", "alpha")}
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        names = {p.name for p in parameters}
        dropped = [key for key in ("mask", "hard_loss") if key in kwargs and key not in names]
        if dropped:
            raise TypeError(
                f"the registered loss {getattr(fn, '__name__', fn)!r} does not accept {dropped}, which dict batches "
                "need (padding mask, the student's own loss): add `mask=None, hard_loss=None` (or **kwargs) to it"
            )
    return fn(*args, **kwargs)
