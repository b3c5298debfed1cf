"""The one-pass paths of :func:`~lightning_lowmem.functional.cross_entropy.linear_cross_entropy`: the loss and the
hidden-state gradient (and, in fp32 / fp64, the weight gradient) together, chunk of tokens by chunk of tokens.

Once a chunk's whole logits ``(rows, V)`` are known, so are its log-sum-exp and the gradient of the loss with
respect to them (softmax minus the one-hot target), so the forward computes the gradients for a scalar loss at
once and the backward only scales them by ``grad_output``, as Liger-Kernel's fused linear cross-entropy does.

* **fp32 / fp64** (:func:`fused_loss_and_grads`): all three gradients in forward, three matmuls in all, as the
  unchunked loss. The weight gradient is accumulated over the chunks in place, in the weight's dtype.
* **bf16 / fp16 and autocast** (:func:`fused_loss_and_hidden_grad`): only the hidden-state gradient in forward
  (each chunk's is one matmul over the whole vocabulary, rounded once, as the unchunked loss's); the forward keeps
  each token's log-sum-exp and the backward recomputes the logits a vocabulary slice at a time for the weight
  gradient, each slice of it written once. Four matmuls. Accumulating a bf16 weight gradient over ``k`` token
  chunks instead (three matmuls) rounds it ``k`` times: its error against float64 grows from 1.00x the unchunked
  bf16 loss's at ``k = 1`` to 1.19x at ``k = 2``, 1.46x at ``k = 4`` and 2.2x at ``k = 32``; summing the chunks'
  bf16 products in an fp32 buffer rounds each product first (1.2-1.4x), and CPU matmuls have no bf16 -> fp32
  output, so the exact alternative would be an fp32 matmul (4x slower than bf16 on AVX512-BF16).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from lightning_lowmem._compat.fake_mode import is_fake

__all__ = ["fused_loss_and_grads", "fused_loss_and_hidden_grad"]


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


def fused_loss_and_hidden_grad(
    hidden: torch.Tensor,  # (N, H) in the matmul dtype
    weight: torch.Tensor,  # (V, H) in the matmul dtype
    bias: torch.Tensor | None,  # (V,) in the matmul dtype
    targets: torch.Tensor,  # (N,) valid class indices everywhere
    counted: torch.Tensor,  # (N,) bool
    smoothing: float,
    reduction: str,
    rows: tuple[int, int],
    grad_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(loss, each token's log-sum-exp (N,), grad of hidden for grad_output = 1 in grad_dtype or None)`` for
    bf16 / fp16 matmuls: ``rows = (matmul_rows, softmax_rows)``, the tokens of one matmul's logits (in the matmul
    dtype; their gradient is written over them) and of one fp32 softmax. The logits' gradient is scaled per token
    in fp32 before its one rounding, and each chunk's hidden gradient is one matmul over the whole vocabulary."""
    num_tokens = hidden.shape[0]
    matmul_rows, softmax_rows = rows
    accumulate = torch.float32
    scale, count = _scale(counted, accumulate, reduction)
    grad_hidden = hidden.new_empty(hidden.shape, dtype=grad_dtype) if grad_dtype is not None else None
    losses = hidden.new_empty(num_tokens, dtype=accumulate)
    lse = hidden.new_empty(num_tokens, dtype=accumulate)
    vocab_size = weight.shape[0]
    # buffers reused by every chunk (on CPU a fresh one per chunk pays its page faults again)
    logits_buffer = hidden.new_empty(min(matmul_rows, num_tokens) * vocab_size)
    work_buffer = hidden.new_empty(min(softmax_rows, matmul_rows, num_tokens) * vocab_size, dtype=accumulate)
    for start in chunk_starts(num_tokens, matmul_rows, hidden):
        stop = min(start + matmul_rows, num_tokens)
        logits = logits_buffer[: (stop - start) * vocab_size].view(stop - start, vocab_size)  # matmul dtype
        if bias is None:  # F.linear's matmul, into the buffer
            torch.mm(hidden[start:stop], weight.T, out=logits)
        else:
            torch.addmm(bias, hidden[start:stop], weight.T, out=logits)
        for low in (start + offset for offset in chunk_starts(stop - start, softmax_rows, hidden)):
            high = min(low + softmax_rows, stop)
            part = logits[low - start : high - start]
            work = work_buffer[: (high - low) * vocab_size].view(high - low, vocab_size).copy_(part)
            probs, losses[low:high], lse[low:high] = _chunk_softmax(work, targets[low:high, None], smoothing)
            if grad_hidden is not None:  # the scaled gradient over the logits, rounded once
                part.copy_(probs.mul_(scale[low:high, None]))
            del probs
        if grad_hidden is not None:  # one matmul over the whole vocabulary: rounded once
            torch.mm(logits, weight, out=grad_hidden[start:stop])
        del logits
    return _total(losses, counted, count, reduction), lse, grad_hidden
