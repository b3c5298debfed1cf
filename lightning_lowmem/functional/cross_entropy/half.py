"""The bf16 / fp16 one-pass path of :func:`~lightning_lowmem.functional.cross_entropy.linear_cross_entropy`
(weights in the matmul dtype, no autocast, ``"mean"`` / ``"sum"``).

* **Forward** (:func:`fused_loss_and_hidden_grad`): chunks of tokens; each chunk's logits over the whole vocabulary
  (one matmul) give its loss, softmax statistics and the gradient with respect to the logits (fp32, scaled per
  token, rounded once into the logits' buffer), and one more matmul over the whole vocabulary its hidden-state
  gradient, rounded once as the unchunked loss's.
* **Backward** (:func:`weight_and_bias_grads`): the weight gradient a vocabulary slice at a time, each slice's
  rows one matmul over all tokens, written once (never accumulated over token chunks in bf16, which rounds it once
  per chunk: 1.19x the unchunked loss's error against float64 at 2 chunks, 2.2x at 32). The slice's logits are
  recomputed (the fourth matmul) except for the last tokens, whose logits' gradient the forward kept
  (:class:`GradCache`, in the bytes an fp32 softmax chunk took before): their share of the recomputation is saved.

The pointwise work runs on fp32 blocks of at most :data:`WORK_BYTES` (one cache-sized buffer, reused); the
forward and the backward compute a gradient entry with the same operations on the same values, so the kept entries
equal the recomputed ones. CPU matmuls have no bf16 -> fp32 output (``torch.mm(..., out_dtype=)`` is CUDA-only
in torch 2.13), which is what accumulating over token chunks exactly would need.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from lightning_lowmem._compat.fake_mode import is_fake
from lightning_lowmem.functional.cross_entropy.fused import chunk_starts

__all__ = ["GradCache", "fused_loss_and_hidden_grad", "hybrid_backward", "weight_and_bias_grads", "work_rows"]

_LOG2_E = 1.0 / math.log(2.0)
WORK_BYTES = 2 << 20  # an fp32 block of the pointwise work (per-core cache sized: ~1.3x faster than 32 MiB ones)


def work_rows(width: int, rows: int) -> int:
    """Rows of an fp32 work block over ``width`` classes: at most :data:`WORK_BYTES` and half of ``rows``."""
    return max(1, min(WORK_BYTES // (4 * width), rows // 2))


class GradCache:
    """The logits' gradient of the last ``N - first`` tokens (for ``grad_output = 1``), kept by the forward in the
    matmul dtype, one ``(N - first, columns)`` tensor per vocabulary slice of the backward (each freed once used)."""

    __slots__ = ("columns", "first", "slices")

    def __init__(self, hidden: torch.Tensor, vocab_size: int, columns: int, cached_rows: int) -> None:
        self.first = hidden.shape[0] - cached_rows
        self.columns = columns
        self.slices: list[torch.Tensor | None] = [
            hidden.new_empty(cached_rows, min(start + columns, vocab_size) - start)
            for start in range(0, vocab_size, columns)
        ]

    def store(self, grad_logits: torch.Tensor, start: int) -> None:
        """Keep the cached rows of a chunk's ``(rows, V)`` logits' gradient (its first token is ``start``)."""
        low, high = max(self.first, start), start + grad_logits.shape[0]
        if low >= high:
            return
        rows = grad_logits[low - start :]
        for index, part in enumerate(self.slices):
            if part is not None:
                columns = slice(index * self.columns, index * self.columns + part.shape[1])
                part[low - self.first : high - self.first].copy_(rows[:, columns])

    def take(self, index: int) -> torch.Tensor:
        """Slice ``index``'s kept rows; it and every slice before it are dropped here."""
        part = self.slices[index]
        self.slices[: index + 1] = [None] * (index + 1)
        if part is None:
            raise RuntimeError(f"vocabulary slice {index}'s kept logits' gradient was already used")
        return part


def _exp_shifted_(logits: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``exp(logits - shift)`` per row, in place, as ``exp2((logits - shift) * log2(e))``: torch's CPU ``exp2`` is
    ~4x faster than its ``exp`` (AVX512, torch 2.13), its relative error 1e-7 for arguments in [-1, 0], 1e-6 down
    to -20, 4e-6 down to -87 (``exp``: 6e-8), far below the 2^-9 of the bf16 rounding each entry then takes."""
    return logits.sub_(shift[:, None]).mul_(_LOG2_E).exp2_()


def _softmax_stats_(
    logits: torch.Tensor, targets: torch.Tensor, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(each token's loss, row maximum, sum of exp(logit - maximum))``; ``logits`` (fp32) becomes
    ``exp(logit - maximum)`` in place."""
    picked = logits.gather(1, targets[:, None]).squeeze(1)
    mean_logit = logits.mean(dim=-1) if smoothing else None
    row_max = logits.amax(dim=-1)
    total = _exp_shifted_(logits, row_max).sum(dim=-1)
    # (1 - eps) * (lse - z_y) + eps * (lse - mean_v z_v): F.cross_entropy's label smoothing
    loss = row_max + total.log() - (1.0 - smoothing) * picked
    if mean_logit is not None:
        loss = loss - smoothing * mean_logit
    return loss, row_max, total


def _grad_from_exp_(
    exps: torch.Tensor,  # (rows, columns) fp32: exp(logit - row maximum)
    scale: torch.Tensor,  # (rows,) d loss / d loss_i
    total: torch.Tensor,  # (rows,) each row's sum of exp(logit - maximum)
    hits: torch.Tensor,  # (rows,) the target's column (any column where target_weight is 0)
    target_weight: torch.Tensor,  # (rows,) 1 where the target is one of these columns, else 0
    smoothing: float,
    vocab_size: int,
) -> torch.Tensor:
    """``scale * (softmax - the (smoothed) one-hot target)`` in place of ``exps`` (the forward and the backward both
    call it, so a kept entry equals a recomputed one)."""
    exps.mul_((scale / total)[:, None])
    if smoothing:
        exps.sub_((scale * (smoothing / vocab_size))[:, None])
    return exps.scatter_add_(1, hits[:, None], (target_weight * (scale * (smoothing - 1.0)))[:, None])


def _scale(counted: torch.Tensor, reduction: str, grad_output: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d loss_i (fp32): ``grad_output`` (1 when ``None``), ``/ count`` for a mean, 0 where ignored."""
    scale = grad_output.float() if grad_output is not None else counted.new_ones((), dtype=torch.float32)
    if reduction == "mean":
        scale = scale / counted.sum().clamp(min=1)
    return torch.where(counted, scale.expand(counted.shape), torch.zeros((), device=counted.device))


def _scales_exactly(grad_output: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kept gradient (for ``grad_output = 1``) times ``grad_output`` is what recomputing gives: 1, or,
    in bf16, a power of two (fp16's narrow exponent range would flush scaled-down entries recomputing keeps)."""
    if is_fake(grad_output):
        return True  # the same bytes either way
    if bool(grad_output == 1):
        return True
    mantissa, _ = torch.frexp(grad_output.detach().float())
    return dtype == torch.bfloat16 and bool(mantissa.abs() == 0.5)


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
    cache_columns: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, GradCache | None]:
    """``(loss, row maxima (N,), sums of exp(logit - maximum) (N,), grad of hidden for grad_output = 1 in grad_dtype
    or None, the kept logits' gradient or None)``. ``rows = (matmul_rows, softmax_rows)``: the tokens of one
    matmul's logits (their gradient written over them) and the bytes of an fp32 softmax chunk (``softmax_rows``
    tokens' fp32 logits), which hold the fp32 work block and, when ``cache_columns`` is given (the backward's slice
    width), a :class:`GradCache` of the last tokens (two bf16 rows per fp32 row)."""
    num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
    matmul_rows, softmax_rows = rows
    scale = _scale(counted, reduction)
    sub_rows = work_rows(vocab_size, softmax_rows)
    cached_rows = min(num_tokens, 2 * (softmax_rows - sub_rows))
    cache = None
    if cache_columns is not None and cached_rows > 0:
        cache = GradCache(hidden, vocab_size, cache_columns, cached_rows)
    grad_hidden = hidden.new_empty(hidden.shape, dtype=grad_dtype) if grad_dtype is not None else None
    losses, row_max, total = (hidden.new_empty(num_tokens, dtype=torch.float32) for _ in range(3))
    # buffers reused by every chunk (on CPU a fresh one per chunk pays its page faults again)
    logits_buffer = hidden.new_empty(min(matmul_rows, num_tokens) * vocab_size)
    work_buffer = hidden.new_empty(min(sub_rows, num_tokens) * vocab_size, dtype=torch.float32)
    ones = torch.ones(num_tokens, device=hidden.device)  # every token's target is in the whole vocabulary
    needs_grad = grad_hidden is not None or cache is not None
    for start in chunk_starts(num_tokens, matmul_rows, hidden):
        stop = min(start + matmul_rows, num_tokens)
        logits = logits_buffer[: (stop - start) * vocab_size].view(stop - start, vocab_size)  # matmul dtype
        if bias is None:  # F.linear's matmul, into the buffer
            torch.mm(hidden[start:stop], weight.T, out=logits)
        else:
            torch.addmm(bias, hidden[start:stop], weight.T, out=logits)
        for low in (start + offset for offset in chunk_starts(stop - start, sub_rows, hidden)):
            high = min(low + sub_rows, stop)
            part = logits[low - start : high - start]
            work = work_buffer[: (high - low) * vocab_size].view(high - low, vocab_size).copy_(part)
            losses[low:high], row_max[low:high], total[low:high] = _softmax_stats_(work, targets[low:high], smoothing)
            if needs_grad:  # the scaled gradient over the logits, rounded once
                tokens = slice(low, high)
                part.copy_(
                    _grad_from_exp_(
                        work, scale[tokens], total[tokens], targets[tokens], ones[tokens], smoothing, vocab_size
                    )
                )
        if grad_hidden is not None:  # one matmul over the whole vocabulary: rounded once
            torch.mm(logits, weight, out=grad_hidden[start:stop])
        if cache is not None:
            cache.store(logits, start)
        del logits
    count = counted.sum()
    loss = torch.where(counted, losses, torch.zeros_like(losses)).sum()
    return (loss / count if reduction == "mean" else loss), row_max, total, grad_hidden, cache


def weight_and_bias_grads(
    hidden: torch.Tensor,  # (N, H) in the matmul dtype
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,  # (V,)
    targets: torch.Tensor,  # (N,) valid class indices everywhere
    counted: torch.Tensor,  # (N,) bool
    stats: tuple[torch.Tensor, torch.Tensor],  # (row maxima, sums of exp) from the forward
    smoothing: float,
    reduction: str,
    columns: int,
    grad_output: torch.Tensor,
    needs: tuple[bool, bool],  # (weight, bias)
    cache: GradCache | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The weight's and the bias' gradients (``None`` where ``needs`` is false), a vocabulary slice of ``columns``
    classes at a time: the slice's logits recomputed for the tokens ``cache`` does not hold (all without one), their
    gradient rounded once, the weight's rows one matmul over all tokens. The cache holds the gradient for
    ``grad_output = 1``; a bf16 one is scaled by a ``grad_output`` that is a power of two (Lightning's
    ``loss / accumulate_grad_batches`` for 2, 4, 8 ... batches: the same bits as recomputing, bf16 having fp32's
    exponent range); for any other, every token's is recomputed."""
    num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
    row_max, total = stats
    if cache is not None and ((needs[1] and bias is not None) or not _scales_exactly(grad_output, hidden.dtype)):
        cache = None  # dropped: the kept gradient is for grad_output = 1 (and the bias' needs its fp32 sums)
    first = cache.first if cache is not None else num_tokens
    scale = _scale(counted, reduction, grad_output)
    grad_weight = torch.empty_like(weight) if needs[0] else None
    grad_bias = torch.zeros(vocab_size, device=weight.device) if needs[1] and bias is not None else None
    sub_rows = work_rows(columns, num_tokens)
    buffer = hidden.new_empty(num_tokens * min(columns, vocab_size))  # the slice's logits, then their gradient
    work_buffer = hidden.new_empty(min(sub_rows, num_tokens) * min(columns, vocab_size), dtype=torch.float32)
    for index, start in ((start // columns, start) for start in chunk_starts(vocab_size, columns, hidden)):
        stop = min(start + columns, vocab_size)
        grad_logits = buffer[: num_tokens * (stop - start)].view(num_tokens, stop - start)
        if first:
            weight_t = weight[start:stop].T
            if bias is None:
                torch.mm(hidden[:first], weight_t, out=grad_logits[:first])
            else:
                torch.addmm(bias[start:stop], hidden[:first], weight_t, out=grad_logits[:first])
        in_slice = (targets >= start) & (targets < stop)
        hits = torch.where(in_slice, targets - start, torch.zeros_like(targets))
        target_weight = in_slice.float()
        for low in chunk_starts(first, sub_rows, hidden):
            high = min(low + sub_rows, first)
            tokens = slice(low, high)
            work = work_buffer[: (high - low) * (stop - start)].view(high - low, stop - start)
            _exp_shifted_(work.copy_(grad_logits[tokens]), row_max[tokens])
            _grad_from_exp_(
                work, scale[tokens], total[tokens], hits[tokens], target_weight[tokens], smoothing, vocab_size
            )
            if grad_bias is not None:
                grad_bias[start:stop] += work.sum(dim=0)
            grad_logits[tokens].copy_(work)
        if cache is not None:
            grad_logits[first:].copy_(cache.take(index))
            if not is_fake(grad_output) and bool(grad_output != 1):
                grad_logits[first:].mul_(grad_output)  # a power of two: exact (in place: no memory)
        if grad_weight is not None:
            torch.mm(grad_logits.T, hidden, out=grad_weight[start:stop])
    return grad_weight, grad_bias.to(bias.dtype) if grad_bias is not None and bias is not None else None


def hybrid_backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, Any, Any]:
    """The bf16 / fp16 one-pass path's gradients: the hidden states' from the forward, scaled; the weight's and the
    bias' a vocabulary slice at a time (:func:`weight_and_bias_grads`; a tied weight's in the embedding's backward,
    after the body's: see :mod:`.tied`). ``ctx`` is the autograd context the forward filled."""
    hidden, weight, bias, targets, counted, row_max, total = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_hidden, ctx.hidden_grad = ctx.hidden_grad, None
    cache, ctx.cache = ctx.cache, None
    if need_hidden and grad_hidden is None:
        raise RuntimeError(
            "linear_cross_entropy's backward ran twice (retain_graph=True): the one-pass path computes the "
            "hidden-state gradient once, in forward. Call it again for a second backward"
        )
    if grad_hidden is not None:  # computed in forward for grad_output = 1 (exact when it is 1)
        grad_hidden = grad_hidden.mul_(grad_output)
    grads_of = functools.partial(
        weight_and_bias_grads,
        hidden,
        weight,
        bias,
        targets,
        counted,
        (row_max, total),
        ctx.smoothing,
        ctx.reduction,
        ctx.columns,
        grad_output,
    )
    defer = need_weight and ctx.tied is not None  # computed by the embedding's backward, after the body's
    grad_weight, grad_bias = grads_of((need_weight and not defer, need_bias), cache)
    if defer:
        ctx.tied.deliver_later(lambda: grads_of((True, False))[0])
    elif ctx.tied is not None and grad_weight is not None:  # handed to the tied embedding's backward
        ctx.tied.deliver(grad_weight)
        grad_weight = None
    return grad_hidden, grad_weight, grad_bias
