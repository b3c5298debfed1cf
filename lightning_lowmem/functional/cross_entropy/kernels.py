"""Fused CUDA kernels for :func:`~lightning_lowmem.functional.cross_entropy.linear_cross_entropy`, optional
extras chosen by its ``kernel=`` argument:

* ``"liger"``: Liger-Kernel's fused linear cross-entropy (``liger_kernel.transformers.functional.
  liger_fused_linear_cross_entropy``; ``pip install 'lightning-lowmem[liger]'``). Chunks of tokens, the
  gradients computed in forward (our one-pass path's design, in Triton).
* ``"cce"``: Apple's Cut Cross-Entropy (``cut_cross_entropy.linear_cross_entropy``;
  ``pip install 'lightning-lowmem[cce]'``). The log-sum-exp in forward, the logits recomputed blockwise in
  backward, gradient entries below the dtype's resolution skipped (its default ``filter_eps``).
* ``"auto"`` (the default): the first of those two that is installed and computes the call, when the tensors are
  on CUDA; ours otherwise (on CPU, on the estimator's fake tensors, for a weight tied to an input embedding under
  :func:`chunk_cross_entropy_`, and for what a library cannot compute: see :func:`refusal`).
* ``"lowmem"``: always ours.

Both libraries return a float32 loss, as ours. What differs from ours: a ``"mean"`` over no counted target is
``0`` under Liger (``nan`` under ours, CCE and ``F.cross_entropy``); invalid targets are checked before the call.
A weight tied to an input embedding gets two gradients under them (theirs and the embedding's, summed by
autograd, as without the chunked loss), one under ours (:mod:`.tied`): ``"auto"`` keeps ours there, an explicit
``"liger"`` / ``"cce"`` computes the same gradient with the second buffer. The estimator traces ours.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch

from lightning_lowmem._compat.fake_mode import is_fake
from lightning_lowmem.functional.config.constants import CROSS_ENTROPY_KERNELS
from lightning_lowmem.functional.cross_entropy.tied import pending

__all__ = ["AUTO_ORDER", "KERNELS", "LIBRARIES", "check_kernel", "kernel_loss", "on_cuda", "refusal", "resolve_kernel"]

KERNELS = CROSS_ENTROPY_KERNELS  # ("auto", "lowmem", "liger", "cce")
AUTO_ORDER = ("liger", "cce")  # what "auto" tries, in order
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MISSING: set[str] = set()  # modules whose import failed once ("auto" does not retry them every step)


@dataclass(frozen=True)
class _Call:
    """One ``linear_cross_entropy`` call, flattened: ``hidden`` ``(N, H)``, ``targets`` ``(N,)``."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    reduction: str
    label_smoothing: float
    targets: torch.Tensor | None = None  # None: only which kernel computes it is asked (resolve_kernel)
    ignore_index: int = -100


@dataclass(frozen=True)
class _Library:
    name: str  # the kernel= value
    module: str  # what is imported
    package: str  # its pip name
    limits: Callable[[ModuleType, _Call], str | None]  # why it cannot compute a call, or None
    call: Callable[[ModuleType, _Call], torch.Tensor]


def on_cuda(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on a CUDA device (a function of its own, so tests can fake it on CPU)."""
    return tensor.device.type == "cuda"


def check_kernel(kernel: Any) -> None:
    """Raise ``ValueError`` unless ``kernel`` is one of :data:`KERNELS`."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        close = difflib.get_close_matches(str(kernel), KERNELS, n=1)
        raise ValueError(
            f"`kernel`={kernel!r} is unknown; choose one of {list(KERNELS)} ('auto': a fused CUDA kernel when one is "
            "installed and the tensors are on CUDA, else ours; 'lowmem': always ours)."
            + (f" Did you mean {close[0]!r}?" if close else "")
        )


def kernel_loss(
    kernel: str,
    hidden: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    targets: torch.Tensor,  # (N,)
    bias: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
) -> torch.Tensor | None:
    """The loss computed by the library ``kernel`` names or ``"auto"`` picks (float32; ``"none"``: ``(N,)``), or
    ``None``: ours computes it.

    Raises:
        ValueError: an unknown ``kernel``; ``"liger"`` / ``"cce"`` for a call that library cannot compute.
        ImportError: ``"liger"`` / ``"cce"`` not installed (one line naming the package and the extra).
        IndexError: a target outside ``[0, V)`` (not ``ignore_index``), before a library runs.
    """
    call = _Call(hidden, weight, bias, reduction, float(label_smoothing), targets, ignore_index)
    chosen = _choose(kernel, call)
    if chosen is None:
        return None
    library, module = chosen
    _check_targets(targets, weight.shape[0], ignore_index)
    return library.call(module, call).float()  # float32 as ours (both libraries already return it)


def resolve_kernel(
    kernel: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> str:
    """What computes ``linear_cross_entropy(hidden, weight, ..., kernel=kernel)``: ``"lowmem"`` (ours), ``"liger"``
    or ``"cce"``.

    Raises:
        ValueError / ImportError: as :func:`kernel_loss`.

    Example::

        >>> resolve_kernel("auto", torch.randn(4, 8), torch.randn(16, 8))  # CPU tensors: ours
        'lowmem'
    """
    chosen = _choose(kernel, _Call(hidden, weight, bias, reduction, float(label_smoothing)))
    return "lowmem" if chosen is None else chosen[0].name


def _choose(kernel: str, call: _Call) -> tuple[_Library, ModuleType] | None:
    """The library (and its module) that computes ``call``; ``None``: ours."""
    check_kernel(kernel)
    hidden, weight = call.hidden, call.weight
    if kernel == "lowmem" or is_fake(hidden) or hidden.device.type == "meta":  # the estimator traces ours
        return None
    if kernel == "auto":
        if not (on_cuda(hidden) and on_cuda(weight)) or pending(weight):  # tied: ours keeps one gradient
            return None
        for name in AUTO_ORDER:
            library = LIBRARIES[name]
            module = _import(library)
            if module is not None and refusal(library, module, call) is None:
                return library, module
        return None
    library = LIBRARIES[kernel]
    module = _import_or_raise(library)
    why = refusal(library, module, call)
    if why is not None:
        raise ValueError(
            f"`kernel`={kernel!r} cannot compute this loss: {why}. Use kernel='auto' (ours computes what "
            f"{library.package} cannot) or 'lowmem'"
        )
    return library, module


def refusal(library: _Library, module: ModuleType, call: _Call) -> str | None:
    """Why ``library`` cannot compute ``call`` (CUDA tensors of a float dtype it takes, the arguments it has), or
    ``None``."""
    devices = {call.hidden.device.type, call.weight.device.type}
    if not (on_cuda(call.hidden) and on_cuda(call.weight)):
        return f"it runs on CUDA tensors only, got {' / '.join(sorted(devices))} ones"
    dtypes = {call.hidden.dtype, call.weight.dtype}
    if not dtypes <= set(_DTYPES):
        return f"it takes float16 / bfloat16 / float32 tensors, got {' / '.join(sorted(map(str, dtypes)))}"
    return library.limits(module, call)


def _check_targets(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise as ``F.cross_entropy`` (and ours) for a class index outside ``[0, V)``: the kernels would read out of
    bounds (one min / max, one synchronisation)."""
    if targets.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(torch.where(targets != ignore_index, targets, 0))).tolist()
    if low < 0 or high >= vocab_size:
        raise IndexError(
            f"`targets` holds class index {low if low < 0 else high}, outside [0, {vocab_size}) for a weight of "
            f"{vocab_size} classes: targets must be class indices or ignore_index={ignore_index}"
        )


def _import(library: _Library) -> ModuleType | None:
    """The library's module, or ``None`` when it does not import (tried once per process)."""
    module = sys.modules.get(library.module)
    if module is not None or library.module in _MISSING:
        return module
    try:
        return importlib.import_module(library.module)
    except ImportError:
        _MISSING.add(library.module)
        return None


def _import_or_raise(library: _Library) -> ModuleType:
    """The library's module, or a one-line ``ImportError`` naming the package and the extra to install."""
    module = sys.modules.get(library.module)
    if module is not None:
        return module
    try:
        return importlib.import_module(library.module)
    except ImportError as error:
        raise ImportError(
            f"kernel={library.name!r} needs the {library.package} package ({library.module} does not import: "
            f"{error}): pip install 'lightning-lowmem[{library.name}]', or use kernel='auto' / 'lowmem'"
        ) from error


# ----------------------------------------------------------------------------- Liger-Kernel
def _liger_limits(module: ModuleType, call: _Call) -> str | None:
    if call.reduction == "none":
        return "reduction='none' (liger-kernel's weight gradient for it was wrong before 0.8.2; ours computes it)"
    needs_weight = call.weight.requires_grad or (call.bias is not None and call.bias.requires_grad)
    if torch.is_grad_enabled() and needs_weight and not call.hidden.requires_grad:
        return "hidden states that need no gradient with a weight that does (liger-kernel then computes no gradient)"
    return None


def _liger_call(module: ModuleType, call: _Call) -> torch.Tensor:
    return module.liger_fused_linear_cross_entropy(
        call.hidden,
        call.weight,
        call.targets,
        bias=call.bias,
        ignore_index=call.ignore_index,
        label_smoothing=call.label_smoothing,
        reduction=call.reduction,
    )


# ----------------------------------------------------------------------------- Cut Cross-Entropy
def _cce_limits(module: ModuleType, call: _Call) -> str | None:
    if call.label_smoothing:
        return f"label_smoothing={call.label_smoothing} (Cut Cross-Entropy has none)"
    if call.bias is not None and "bias" not in inspect.signature(module.linear_cross_entropy).parameters:
        return "a bias (this cut-cross-entropy release, e.g. PyPI's 25.1.1, has no `bias` argument; later ones do)"
    autocast = torch.is_autocast_enabled(call.hidden.device.type)
    if autocast and _version(module) < (25, 6, 3):
        return "autocast (cut-cross-entropy follows it from 25.6.3 on; give it bf16 weights, e.g. 'bf16-true')"
    return None


def _cce_call(module: ModuleType, call: _Call) -> torch.Tensor:
    extra = {"bias": call.bias} if call.bias is not None else {}
    return module.linear_cross_entropy(
        call.hidden, call.weight, call.targets, ignore_index=call.ignore_index, reduction=call.reduction, **extra
    )


def _version(module: ModuleType) -> tuple[int, ...]:
    """``module.__version__`` as numbers (``"25.6.4"`` -> ``(25, 6, 4)``); ``()`` when it has none."""
    return tuple(int(part) for part in re.findall(r"\d+", str(getattr(module, "__version__", "")))[:3])


LIBRARIES: dict[str, _Library] = {
    "liger": _Library("liger", "liger_kernel.transformers.functional", "liger-kernel", _liger_limits, _liger_call),
    "cce": _Library("cce", "cut_cross_entropy", "cut-cross-entropy", _cce_limits, _cce_call),
}
