"""The fp32 / fp64 one-pass path of :func:`~lightning_lowmem.functional.cross_entropy.linear_cross_entropy`
(:func:`fused_loss_and_grads`): the loss and all three gradients together, chunk of tokens by chunk of tokens.

Once a chunk's whole logits ``(rows, V)`` are known, so are its log-sum-exp and the gradient of the loss with
respect to them (softmax minus the one-hot target), so the forward computes the gradients for a scalar loss at
once and the backward only scales them by ``grad_output``, as Liger-Kernel's fused linear cross-entropy does:
three matmuls in all, as the unchunked loss. The weight gradient is accumulated over the chunks in place, in the
weight's dtype. The bf16 / fp16 path, which cannot accumulate that way, is :mod:`.half`.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from lightning_lowmem._compat.fake_mode import is_fake

__all__ = ["chunk_starts", "fused_loss_and_grads"]


def _scale(counted: torch.Tensor, dtype: torch.dtype, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d loss / d loss_i for each token, the number of counted tokens)``: 0 for ignored targets, 1/count for a
    mean."""
    count = counted.sum()
    scale = counted.to(dtype)  # (N,)
    if reduction == "mean":
        scale = scale / count.clamp(min=1)
    return scale, count


def _chunk_softmax(
    logits: torch.Tensor, chunk_targets: torch.Tensor, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(softmax minus the (smoothed) one-hot target, in place of logits, each token's loss, log-sum-exp)``."""
    vocab_size = logits.shape[1]
    picked = logits.gather(1, chunk_targets).squeeze(1)
    mean_logit = logits.mean(dim=-1) if smoothing else None
    row_max = logits.amax(dim=-1)
    probs = logits.sub_(row_max[:, None]).exp_()  # in place: exp(z - max)
    total = probs.sum(dim=-1)
    lse = row_max + total.log()
    # (1 - eps) * (lse - z_y) + eps * (lse - mean_v z_v): F.cross_entropy's label smoothing
    loss = lse - (1.0 - smoothing) * picked
    if mean_logit is not None:
        loss = loss - smoothing * mean_logit
    probs.div_(total[:, None])
    if smoothing:
        probs.sub_(smoothing / vocab_size)
    probs.scatter_add_(1, chunk_targets, probs.new_full(chunk_targets.shape, smoothing - 1.0))
    return probs, loss, lse


def _total(losses: torch.Tensor, counted: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    total = torch.where(counted, losses, torch.zeros_like(losses)).sum()
    return total / count if reduction == "mean" else total


def chunk_starts(total: int, step: int, tensor: torch.Tensor) -> list[int]:
    """Where each chunk of a loop over ``total`` rows, ``step`` at a time, starts. On fake tensors
    (``estimate_memory``) every chunk from the second on starts from the same state and, but for the last, allocates
    and frees what the second does, writing into storage that already exists: the first two and the last show the
    loop's peak, so only they run (``tests/functional/test_cross_entropy_fake.py`` compares with every chunk run)."""
    starts = list(range(0, total, step))
    return starts[:2] + starts[-1:] if len(starts) > 3 and is_fake(tensor) else starts


def fused_loss_and_grads(
    hidden: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,  # (V,)
    targets: torch.Tensor,  # (N,) valid class indices everywhere (ignored ones replaced)
    counted: torch.Tensor,  # (N,) bool: not ignore_index
    smoothing: float,
    reduction: str,
    rows: int,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The loss (``"mean"`` or ``"sum"``) and the gradients of ``(hidden, weight, bias)`` for ``grad_output = 1``
    (``None`` where ``needs`` is false), with at most ``rows`` tokens' logits alive at once (fp32 / fp64)."""
    num_tokens = hidden.shape[0]
    scale, count = _scale(counted, hidden.dtype, reduction)
    need_hidden, need_weight, need_bias = needs
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros_like(weight) if need_weight else None
    grad_bias = torch.zeros_like(bias) if need_bias and bias is not None else None
    any_grad = need_hidden or need_weight or grad_bias is not None
    losses = hidden.new_empty(num_tokens)
    for start in chunk_starts(num_tokens, rows, hidden):
        stop = min(start + rows, num_tokens)
        chunk, chunk_targets = hidden[start:stop], targets[start:stop, None]  # (r, H), (r, 1)
        logits = F.linear(chunk, weight, bias)  # (r, V): the only big tensor
        probs, losses[start:stop], _ = _chunk_softmax(logits, chunk_targets, smoothing)
        if not any_grad:
            continue
        chunk_scale = scale[start:stop, None]  # (r, 1): 0 for ignored targets
        if grad_bias is not None:
            grad_bias.addmv_(probs.T, chunk_scale.squeeze(1))
        if grad_weight is not None:  # (V, H) accumulated in place over the chunks
            grad_weight.addmm_(probs.T, chunk * chunk_scale)
        if grad_hidden is not None:
            torch.mm(probs, weight, out=grad_hidden[start:stop]).mul_(chunk_scale)
        del logits, probs
    return _total(losses, counted, count, reduction), [grad_hidden, grad_weight, grad_bias]
