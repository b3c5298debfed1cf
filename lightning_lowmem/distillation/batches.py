"""How a distillation step reads a batch: which positions count, which labels, the teacher's dtype.

Pure functions (no Lightning), used by :class:`~lightning_lowmem.distillation.DistillationModule` and its
cache. Two batch conventions are understood:

* ``(inputs, targets, ...)`` tuples / lists: every position whose target is not ``ignore_index`` counts;
* dict batches (Hugging Face): ``labels`` (when present, of the logits' position shape) and the attention
  mask select the positions: a position counts when its label is not ``ignore_index`` (-100) **and** its
  ``attention_mask`` is 1. For encoder-decoder outputs (``encoder_last_hidden_state`` present) the logits
  are decoder positions, so ``decoder_attention_mask`` is used instead of the encoder's ``attention_mask``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from lightning_lowmem._compat import tree_map

from lightning_lowmem.model_io import has_forward_batch, output_loss, tensor_leaves

__all__ = [
    "UNSHIFTED_LABELS_WARNING",
    "cast_floating",
    "counted",
    "first_tensor",
    "hard_label_loss",
    "position_mask",
    "takes_labels",
]

UNSHIFTED_LABELS_WARNING = (
    "DistillationModule: the student returned no `.loss` for a dict batch with `labels`, so the hard-label term is a "
    "cross-entropy of its logits against `labels` position by position (no shift). For a causal LM whose labels are "
    "its input ids, return the model's own `.loss` (take `labels` in forward) or override `batch_targets` to shift them."
)


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor inside ``batch`` (to find its device), or ``None``."""
    leaves = tensor_leaves(batch)
    return leaves[0] if leaves else None


def cast_floating(batch: Any, dtype: torch.dtype) -> Any:
    """``batch`` with every floating-point tensor cast to ``dtype`` (token ids, masks and labels untouched)."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)  # BatchEncoding & co.

    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    return tree_map(cast, batch)


def takes_labels(model: nn.Module) -> bool:
    """Whether ``model.forward`` accepts a ``labels`` keyword (by name or ``**kwargs``): Hugging Face models do,
    and then return their own ``.loss`` (shifted for causal LMs)."""
    if has_forward_batch(model):
        return True  # the model's own override gets the whole batch
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "labels" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _is_encoder_decoder(output: Any) -> bool:
    return isinstance(output, Mapping) and output.get("encoder_last_hidden_state") is not None


def position_mask(
    batch: Any, logits: torch.Tensor, output: Any = None, ignore_index: int = -100
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The hard-label targets of ``batch`` and the positions of ``logits`` that count in the losses.

    Args:
        batch: a ``(inputs, targets, ...)`` tuple / list, a dict batch, or a bare tensor.
        logits: the student's logits ``(B, C)`` or ``(B, T, V)``; positions are ``logits.shape[:-1]``.
        output: the model output the logits came from (tells encoder-decoder outputs apart). Default: ``None``.
        ignore_index: label value of positions that do not count. Default: -100.

    Returns:
        ``(targets, mask)``: targets of the positions' shape (or ``None``) and a ``bool`` mask of the positions'
        shape (or ``None`` when nothing tells positions apart: all count).

    Example::

        >>> ids = torch.tensor([[5, 6, 7, 0]])
        >>> batch = {"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0]]),
        ...          "labels": torch.tensor([[5, 6, -100, -100]])}
        >>> position_mask(batch, torch.zeros(1, 4, 10))[1]
        tensor([[ True,  True, False, False]])
    """
    positions = logits.shape[:-1]
    if isinstance(batch, (tuple, list)):
        targets = batch[1] if len(batch) > 1 and isinstance(batch[1], torch.Tensor) else None
        return targets, None if targets is None else targets != ignore_index
    if not isinstance(batch, Mapping):
        return None, None
    mask = None
    labels = batch.get("labels")
    targets = labels if isinstance(labels, torch.Tensor) and labels.shape == positions else None
    if targets is not None:
        mask = targets != ignore_index
    key = "decoder_attention_mask" if _is_encoder_decoder(output) else "attention_mask"
    attention = batch.get(key)
    if isinstance(attention, torch.Tensor) and attention.shape == positions:
        attended = attention.to(torch.bool)
        mask = attended if mask is None else mask & attended
    return targets, mask


def counted(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The entries of ``values`` at the counted positions (``mask``), flattened; all of them without a mask."""
    return values[mask] if mask is not None else values.reshape(-1)


def hard_label_loss(
    output: Any, logits: torch.Tensor, targets: torch.Tensor | None, mask: torch.Tensor | None, ignore_index: int
) -> torch.Tensor | None:
    """The model's own ``.loss`` if its output has one, else the cross-entropy of ``logits`` against ``targets``
    on the counted positions (``None`` without targets).

    Example::

        >>> logits = torch.tensor([[[2.0, 0.0], [0.0, 2.0]]])
        >>> round(float(hard_label_loss(None, logits, torch.tensor([[0, 0]]), torch.tensor([[True, False]]), -100)), 4)
        0.1269
    """
    loss = output_loss(output)
    if loss is not None or targets is None:
        return loss
    flat = targets.reshape(-1)
    if mask is not None:
        flat = torch.where(mask.reshape(-1), flat, ignore_index)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), flat, ignore_index=ignore_index)
