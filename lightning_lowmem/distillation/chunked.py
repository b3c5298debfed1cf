"""Token-level distillation without the student's whole ``(tokens, vocabulary)`` logits.

Under :class:`~lightning_lowmem.ChunkedCrossEntropy` a student language model's head returns
:class:`~lightning_lowmem.functional.cross_entropy.DeferredLogits` in training. :func:`chunked_kd_loss` computes
:func:`~lightning_lowmem.distillation.losses.kd_loss`'s distillation term from them chunk by chunk: each chunk of
positions is one ``torch.utils.checkpoint`` call (its student logits made, reduced to the KL sum, freed, and made
again in backward), so at most one chunk of student logits and their softmax is alive. The teacher's logits
(computed without gradient) are read a chunk at a time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_lowmem.distillation.losses import check_kd_arguments, kl_per_position
from lightning_lowmem.functional.cross_entropy.linear import default_chunk_size
from lightning_lowmem.functional.cross_entropy.models import DeferredLogits

__all__ = ["chunked_kd_loss", "deferred_argmax"]


def chunked_kd_loss(
    student: DeferredLogits,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor | None = None,
    temperature: float = 2.0,
    alpha: float = 0.5,
    ignore_index: int = -100,
    *,
    mask: torch.Tensor | None = None,
    hard_loss: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """:func:`~lightning_lowmem.distillation.losses.kd_loss` of deferred student logits, in chunks of positions.

    Same value and gradients as ``kd_loss`` on the materialised logits (the KL computed in float32). The hard-label
    term is ``hard_loss`` (a Hugging Face student's own ``.loss``, itself chunked under the callback) or, without
    it, a chunked cross-entropy against ``targets`` position by position.

    Raises:
        ValueError: as ``kd_loss``: ``temperature`` <= 0, ``alpha`` outside [0, 1], shapes that do not match, no
            hard-label term while ``alpha < 1``.
    """
    from lightning_lowmem.functional.cross_entropy.linear import linear_cross_entropy

    check_kd_arguments(temperature, alpha)
    if tuple(student.shape) != tuple(teacher_logits.shape):
        raise ValueError(
            f"student output shape {tuple(student.shape)} cannot be matched to teacher output shape "
            f"{tuple(teacher_logits.shape)}: distillation compares them position by position"
        )
    hidden = student.hidden.reshape(-1, student.hidden.shape[-1])  # (N, H)
    teacher = teacher_logits.reshape(-1, teacher_logits.shape[-1])  # (N, V)
    keep = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    if mask is not None:
        keep = keep & mask.reshape(-1).to(torch.bool)
    if targets is not None:
        keep = keep & (targets.reshape(-1) != ignore_index)
    loss = hidden.new_zeros((), dtype=torch.float32)
    if alpha > 0:
        rows = chunk_size or default_chunk_size(hidden.shape[0], teacher.shape[-1])
        head = student.head
        kl_sum = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], rows):
            stop = start + rows
            kl_sum = kl_sum + checkpoint(
                _kl_sum,
                hidden[start:stop],
                head.weight,
                head.bias,
                teacher[start:stop],
                keep[start:stop],
                temperature,
                use_reentrant=False,
            )
        kl_mean = kl_sum / keep.sum().clamp_min(1)  # no position counts: 0, not NaN (as kd_loss)
        loss = loss + alpha * temperature**2 * kl_mean
    if alpha < 1:
        if hard_loss is not None:
            loss = loss + (1 - alpha) * hard_loss
        elif targets is None:
            raise ValueError(f"`targets` are required for the hard-label term when `alpha`={alpha} < 1")
        else:
            flat_targets = torch.where(keep, targets.reshape(-1), ignore_index)
            head = student.head
            loss = loss + (1 - alpha) * linear_cross_entropy(
                hidden, head.weight, flat_targets, bias=head.bias, ignore_index=ignore_index, chunk_size=chunk_size
            )
    return loss


def _kl_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher: torch.Tensor,
    keep: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Sum over the kept positions of ``KL(softmax(teacher / T) || softmax(student / T))`` for one chunk."""
    kl = kl_per_position(F.linear(hidden, weight, bias).float(), teacher.float(), temperature)  # (rows,)
    return torch.where(keep, kl, 0.0).sum()


@torch.no_grad()
def deferred_argmax(logits: DeferredLogits, chunk_size: int | None = None) -> torch.Tensor:
    """The class index of each position's largest logit, computed a chunk at a time (for agreement metrics)."""
    hidden = logits.hidden.reshape(-1, logits.hidden.shape[-1])
    head = logits.head
    rows = chunk_size or default_chunk_size(hidden.shape[0], head.weight.shape[0])
    parts: list[Any] = [
        F.linear(hidden[s : s + rows], head.weight, head.bias).argmax(-1) for s in range(0, hidden.shape[0], rows)
    ]
    return torch.cat(parts).view(logits.shape[:-1])
