"""Liger-Kernel's fused linear cross-entropy (Triton, CUDA) behind :func:`linear_cross_entropy`, when installed.

``pip install 'lightning-lowmem[liger]'`` (``liger-kernel``): on CUDA tensors, ``backend="auto"`` (the default)
computes the loss with Liger's kernel, which holds a chunk of logits at a time too and computes the gradients in
forward (as the fp32 one-pass path here does), in fused Triton kernels. Everything else (CPU, fake tensors under the
estimator, ``reduction="none"``, a weight tied to an embedding under :func:`chunk_cross_entropy_`, which shares
one gradient buffer with the embedding) runs the torch paths. The import is lazy: ``import lightning_lowmem``
never imports Liger.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = ["BACKENDS", "liger_loss", "use_liger"]

BACKENDS = ("auto", "torch", "liger")
_MODULE = "liger_kernel.transformers.functional"


def _liger_function(required: bool) -> Any:
    """Liger's ``liger_fused_linear_cross_entropy``, or ``None`` when it is not installed (raises if ``required``)."""
    try:
        module = importlib.import_module(_MODULE)
    except ImportError as error:
        if required:
            raise ImportError(
                f"`backend='liger'` needs Liger-Kernel ({_MODULE} did not import: {error}); install it with "
                "`pip install 'lightning-lowmem[liger]'` or pass backend='auto' / 'torch'"
            ) from error
        return None
    return module.liger_fused_linear_cross_entropy


def use_liger(backend: str, hidden: torch.Tensor, reduction: str, tied: bool) -> Any:
    """Liger's function when ``backend`` asks for it (``"liger"``) or allows it (``"auto"`` on CUDA, installed),
    for a ``"mean"`` / ``"sum"`` loss whose weight is not tied to an embedding; else ``None``."""
    if backend == "torch" or reduction == "none" or tied:
        return None
    if backend == "auto" and hidden.device.type != "cuda":
        return None
    return _liger_function(required=backend == "liger")


def liger_loss(
    function: Any,
    hidden: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    targets: torch.Tensor,  # (N,)
    bias: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
) -> torch.Tensor:
    """The loss from Liger's function, its arguments named (their order changed between Liger releases)."""
    return function(
        input=hidden,
        weight=weight,
        target=targets,
        bias=bias,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )
