"""`linear_cross_entropy`: the cross-entropy of ``hidden @ weight.T`` without the whole logits, ever.

A language model's training peak is usually its output head: ``B·T·V`` logits (128,256 classes for a
Llama-3 vocabulary), an fp32 upcast of them and the log-softmax saved for backward, all alive at the start of
the loss backward. Three paths, all holding at most one chunk of logits:

* **One pass** (fp32 / fp64 weights outside autocast, ``"mean"`` / ``"sum"``; :mod:`.fused`): chunks of tokens,
  each chunk's whole logits give its log-sum-exp and the gradient with respect to them at once, so the forward
  computes all gradients (three matmuls, as the unchunked loss) and the backward scales them by ``grad_output``.
* **One pass for the hidden states** (bf16 / fp16 weights outside autocast, ``"mean"`` / ``"sum"``; :mod:`.half`):
  the same chunks give the hidden-state gradient in forward (one matmul over the whole vocabulary per chunk,
  rounded once) and each token's softmax statistics; the backward recomputes the logits a vocabulary slice at a
  time for the weight gradient, each slice of it written once (not accumulated over chunks in bf16). Four matmuls,
  less the recomputation of the last tokens' logits, whose gradient the forward keeps (in the bytes an fp32
  softmax chunk took).
* **Two passes** (autocast, ``"none"``): the forward walks the vocabulary in slices and keeps, per token, only the
  log-sum-exp (an online log-sum-exp over the slices); the backward recomputes the logits one slice at a time and
  writes each slice's weight gradient once, the hidden-state gradient accumulated in fp32 (each slice's matmul in
  fp32, so it is rounded once). Four matmuls, one in fp32.

A weight tied to an input embedding (under :func:`chunk_cross_entropy_`) gets one gradient buffer: the loss hands
its weight gradient to the embedding's backward, which adds its rows into it (:mod:`.tied`).

The recomputing paths follow Apple's Cut Cross-Entropy (log-sum-exp in forward, recompute in backward), the one-pass
paths Liger-Kernel's fused linear cross-entropy (gradients in forward), both with plain torch ops, so they run on
CPU and CUDA, under autocast, and on fake tensors (the estimator traces them). torchtune's
``CEWithChunkedOutputLoss`` chunks the logits but still materialises all of them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from lightning_lowmem._compat.fake_mode import is_fake
from lightning_lowmem.functional.cross_entropy.fused import chunk_starts, fused_loss_and_grads
from lightning_lowmem.functional.cross_entropy.half import fused_loss_and_hidden_grad, hybrid_backward
from lightning_lowmem.functional.cross_entropy.kernels import kernel_loss
from lightning_lowmem.functional.cross_entropy.tied import TiedGradient, claim

__all__ = ["REDUCTIONS", "default_chunk_size", "linear_cross_entropy"]

REDUCTIONS = ("mean", "sum", "none")
_MiB = 1 << 20
_MAX_CHUNK_BYTES = 32 * _MiB  # a chunk's fp32 logits stay under this ...
_CHUNK_FRACTION = 8  # ... and under 1/8 of the whole logits
_ONE_CHUNK_BYTES = 8 * _MiB  # whole logits up to this size are computed in one chunk
_MATMUL_ROWS = 256  # bf16 / fp16 matmuls over the whole vocabulary: from ~256 rows on, as fast per row as any


def default_chunk_size(num_tokens: int, vocab_size: int) -> int:
    """Tokens per chunk when ``chunk_size`` is not given: a chunk's fp32 logits are at most 1/8 of the whole
    and at most 32 MiB (whole logits up to 8 MiB are one chunk).

    Example::

        >>> default_chunk_size(2048, 32_000)  # 250 MiB of logits -> chunks of 256 tokens (31 MiB)
        256
        >>> default_chunk_size(64, 512)  # 128 KiB of logits: one chunk
        64
    """
    whole = num_tokens * vocab_size * 4
    if whole <= _ONE_CHUNK_BYTES:
        return max(num_tokens, 1)
    target = min(whole // _CHUNK_FRACTION, _MAX_CHUNK_BYTES)
    return max(1, target // (vocab_size * 4))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, targets, ...)`` computed in chunks of tokens: the
    ``(tokens, classes)`` logits never exist whole, in forward or backward.

    Same loss and gradients (for ``hidden``, ``weight`` and ``bias``) as the unchunked expression within fp32
    rounding. The loss is float32 whatever the inputs' dtype (float64 for float64 inputs) (logits are upcast per chunk, as Hugging Face
    upcasts them); gradients come back in the inputs' dtypes, the hidden-state gradient accumulated in fp32.
    Under autocast the matmuls run in the autocast dtype, in backward too.

    Args:
        hidden: ``(..., H)`` the last hidden states (after the final norm), e.g. ``(B, T, H)``.
        weight: ``(V, H)`` the output head's weight (``lm_head.weight``; tied embeddings work as they are).
        targets: ``(...)`` class indices, ``hidden``'s leading shape (already shifted for a causal LM).
        bias: ``(V,)`` the head's bias. Default: ``None``.
        ignore_index: targets equal to it add nothing and are not counted by ``"mean"``. Default: ``-100``.
        reduction: ``"mean"`` (over counted targets), ``"sum"`` or ``"none"`` (one loss per target, shaped
            like ``targets``). Default: ``"mean"``.
        label_smoothing: in ``[0, 1]``, as ``F.cross_entropy``'s. Default: ``0.0``.
        chunk_size: the size of the logits held at once, in tokens' worth of whole rows: both passes walk the
            vocabulary in slices of ``chunk_size * V / N`` classes for all ``N`` tokens. Default: ``None`` =
            :func:`default_chunk_size` (a slice's logits at most 1/8 of the whole, 32 MiB).
        kernel: ``"auto"`` (a fused CUDA kernel, Liger-Kernel's or Cut Cross-Entropy's, when one is installed,
            the tensors are on CUDA and it computes the call; else ours), ``"lowmem"`` (ours), ``"liger"`` or
            ``"cce"`` (that one, or an error): :mod:`.kernels`. Default: ``"auto"``.

    Returns:
        A float32 scalar (``"mean"`` / ``"sum"``; ``nan`` for a mean over no counted target, as
        ``F.cross_entropy``) or a float32 tensor shaped like ``targets`` (``"none"``).

    Raises:
        ValueError / TypeError: shapes that do not fit together, non-integer targets, an unknown
            ``reduction``, ``label_smoothing`` outside ``[0, 1]``, ``chunk_size`` not a positive int, an unknown
            ``kernel`` or one that cannot compute the call.
        ImportError: ``kernel="liger"`` / ``"cce"`` and that library is not installed.

    Example::

        >>> hidden, weight = torch.randn(2, 16, 8, requires_grad=True), torch.randn(100, 8, requires_grad=True)
        >>> targets = torch.randint(100, (2, 16))
        >>> loss = linear_cross_entropy(hidden, weight, targets, chunk_size=5)
        >>> torch.allclose(loss, F.cross_entropy((hidden @ weight.T).flatten(0, 1), targets.flatten()))
        True
    """
    _check(hidden, weight, targets, bias, reduction, label_smoothing, chunk_size)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, H), a view when contiguous
    flat_targets = targets.reshape(-1)
    fused = kernel_loss(kernel, flat_hidden, weight, flat_targets, bias, ignore_index, reduction, label_smoothing)
    if fused is not None:  # a fused CUDA kernel computed it (.kernels)
        return fused.view(targets.shape) if reduction == "none" else fused
    num_tokens = flat_hidden.shape[0]
    rows = chunk_size if chunk_size is not None else default_chunk_size(num_tokens, weight.shape[0])
    # bf16 / fp16: a matmul's chunk of tokens at least _MATMUL_ROWS (its fp32 softmax still `rows` at a time)
    matmul_rows = rows if chunk_size is not None else max(rows, min(_MATMUL_ROWS, num_tokens // _CHUNK_FRACTION))
    in_graph = torch.is_grad_enabled()
    tied = claim(weight, flat_hidden) if in_graph and weight.requires_grad else None
    loss = _LinearCrossEntropy.apply(
        flat_hidden,
        weight,
        bias,
        flat_targets,
        ignore_index,
        float(label_smoothing),
        reduction,
        rows,
        tied,
        in_graph,
        matmul_rows,
    )
    return loss.view(targets.shape) if reduction == "none" else loss


class _LinearCrossEntropy(torch.autograd.Function):
    """Both passes walk the vocabulary in slices of ``columns`` classes (each slice's logits for every token, as
    many as ``rows`` tokens' whole logits): the weight is read once per pass, the (smaller) hidden states once per
    slice. Forward: an online log-sum-exp (the running maximum rescales the running sum, as flash attention does)
    and each token's target logit. Backward: each slice's logits again, their softmax minus the one-hot target."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,  # (N, H)
        weight: torch.Tensor,  # (V, H)
        bias: torch.Tensor | None,  # (V,)
        targets: torch.Tensor,  # (N,)
        ignore_index: int,
        smoothing: float,
        reduction: str,
        rows: int,
        tied: TiedGradient | None,
        in_graph: bool,
        matmul_rows: int,
    ) -> torch.Tensor:
        num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
        counted = targets != ignore_index  # (N,)
        safe_targets = torch.where(counted, targets, torch.zeros_like(targets))  # valid indices everywhere
        _check_targets(safe_targets, vocab_size, ignore_index)
        accumulate = _accumulation_dtype(hidden)
        ctx.tied, ctx.fused_grads, ctx.fused, ctx.hidden_grad, ctx.hybrid, ctx.cache = (
            tied,
            None,
            False,
            None,
            False,
            None,
        )
        ctx.autocast = _autocast_state(hidden.device.type)
        needs = tuple(ctx.needs_input_grad[:3]) if in_graph else (False,) * 3  # no_grad: the loss only
        if reduction != "none" and ctx.autocast is None and hidden.dtype == weight.dtype == accumulate:
            ctx.fused = True
            loss, ctx.fused_grads = fused_loss_and_grads(
                hidden,
                weight,
                bias,
                safe_targets,
                counted,
                smoothing,
                reduction,
                rows,
                needs,  # type: ignore[arg-type]
            )
            return loss
        if reduction != "none" and ctx.autocast is None and hidden.dtype == weight.dtype:
            # bf16 / fp16: the hidden gradient in forward, the weight's in backward (autocast keeps the two-pass
            # path: it casts the weight a slice at a time, never whole)
            ctx.columns = _columns(rows, num_tokens, vocab_size)
            # the last tokens' logits' gradient kept for the weight's (not for a tied weight, whose gradient the
            # embedding's backward computes later, nor for a bias', summed in fp32)
            keep = needs[1] and tied is None and not needs[2]
            loss, row_max, total, ctx.hidden_grad, ctx.cache = fused_loss_and_hidden_grad(
                hidden,
                weight,
                bias,
                safe_targets,
                counted,
                smoothing,
                reduction,
                (matmul_rows, rows),
                hidden.dtype if needs[0] else None,
                ctx.columns if keep else None,
            )
            ctx.hybrid = True
            ctx.save_for_backward(hidden, weight, bias, safe_targets, counted, row_max, total)
            ctx.smoothing, ctx.reduction = smoothing, reduction
            return loss
        running_max = hidden.new_full((num_tokens,), float("-inf"), dtype=accumulate)
        running_sum = hidden.new_zeros(num_tokens, dtype=accumulate)  # sum of exp(logit - running_max)
        picked = hidden.new_zeros(num_tokens, dtype=accumulate)  # each token's target logit
        logit_sum = hidden.new_zeros(num_tokens, dtype=accumulate) if smoothing else None
        columns = _columns(rows, num_tokens, vocab_size)
        token_index = torch.arange(num_tokens, device=hidden.device)
        for start in _slice_starts(vocab_size, columns, hidden):
            stop = min(start + columns, vocab_size)
            bias_slice = bias[start:stop] if bias is not None else None
            logits = F.linear(hidden, weight[start:stop], bias_slice).to(
                accumulate
            )  # (N, columns): the only big tensor
            slice_max = torch.maximum(running_max, logits.amax(dim=-1))
            running_sum.mul_(torch.exp(running_max - slice_max))
            running_max = slice_max
            if logit_sum is not None:
                logit_sum += logits.sum(dim=-1)
            in_slice = (safe_targets >= start) & (safe_targets < stop)
            hits = torch.where(in_slice, safe_targets - start, torch.zeros_like(safe_targets))
            picked += torch.where(in_slice, logits[token_index, hits], 0.0)
            running_sum += logits.sub_(running_max[:, None]).exp_().sum(dim=-1)
            del logits
        lse = running_max + running_sum.log()  # (N,) log-sum-exp of each token's logits
        # (1 - eps) * (lse - z_y) + eps * (lse - mean_v z_v): F.cross_entropy's label smoothing
        losses = lse - (1.0 - smoothing) * picked
        if logit_sum is not None:
            losses = losses - smoothing * logit_sum / vocab_size
        losses = torch.where(counted, losses, torch.zeros_like(losses))
        count = counted.sum()
        ctx.save_for_backward(hidden, weight, bias, safe_targets, counted, lse, count)
        ctx.smoothing, ctx.reduction, ctx.columns = smoothing, reduction, columns
        if reduction == "none":
            return losses
        total = losses.sum()
        return total / count if reduction == "mean" else total

    @staticmethod
    @once_differentiable  # the gradients are computed with in-place ops: no double backward
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.fused:
            if ctx.fused_grads is None:
                raise RuntimeError(
                    "linear_cross_entropy's backward ran twice (retain_graph=True): the fp32 one-pass path computes "
                    "its gradients once, in forward. Call it again for a second backward"
                )
            # computed in forward for grad_output = 1: scale them
            grads, ctx.fused_grads = ctx.fused_grads, None
            grads = [grad.mul_(grad_output) if grad is not None else None for grad in grads]
            grads[1] = _deliver(ctx.tied, grads[1])
            return (*grads, None, None, None, None, None, None, None, None)
        if ctx.hybrid:
            return (*hybrid_backward(ctx, grad_output), None, None, None, None, None, None, None, None)
        hidden, weight, bias, targets, counted, lse, count = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        num_tokens, vocab_size, smoothing = hidden.shape[0], weight.shape[0], ctx.smoothing
        # d loss / d loss_i for each token: grad_output, / count for a mean, 0 where the target is ignored: it
        # scales the rows of each slice's logits' gradient (in fp32, before the matmuls round anything)
        accumulate = lse.dtype
        scale = grad_output.to(accumulate)
        if ctx.reduction == "mean":
            scale = scale / count
        scale = torch.where(counted, scale.expand(num_tokens), torch.zeros_like(lse))  # (N,)
        dtype = ctx.autocast or hidden.dtype  # the forward's matmul dtype (autocast's, else the inputs')
        hidden_c = hidden.to(dtype)  # no copy without autocast
        logits_of = functools.partial(
            _slice_grad_logits, hidden_c, weight, bias, targets, counted, lse, scale, smoothing
        )
        # a tied weight's gradient is computed by the embedding's backward, after the body's (see .tied)
        defer = need_weight and ctx.tied is not None
        grad_weight = torch.empty_like(weight) if need_weight and not defer else None
        grad_hidden = torch.zeros(hidden.shape, dtype=accumulate, device=hidden.device) if need_hidden else None
        grad_bias = torch.empty_like(bias) if need_bias else None
        loop = need_hidden or need_bias or grad_weight is not None
        workspace = _Workspace.make(hidden_c, ctx.columns, accumulate) if loop else None
        for start in _slice_starts(vocab_size, ctx.columns, hidden) if loop else ():
            stop = min(start + ctx.columns, vocab_size)
            grad_logits = logits_of(start, stop, workspace)  # (N, columns) in fp32
            if grad_bias is not None:
                grad_bias[start:stop] = grad_logits.sum(dim=0)
            if grad_weight is not None:
                _write_weight_slice(grad_weight, _rounded(grad_logits, dtype, workspace), hidden_c, start, stop)
            if grad_hidden is not None:  # (N, H), the matmul in fp32 too: one rounding, at the end
                grad_hidden.addmm_(grad_logits, weight[start:stop].to(dtype).to(accumulate))
            del grad_logits
        del workspace
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        if defer:
            ctx.tied.deliver_later(functools.partial(_weight_gradient, logits_of, weight, hidden_c, ctx.columns))
        else:
            grad_weight = _deliver(ctx.tied, grad_weight)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def _slice_grad_logits(
    hidden: torch.Tensor,  # (N, H) in the matmul dtype
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    counted: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    smoothing: float,
    start: int,
    stop: int,
    workspace: _Workspace | None = None,
) -> torch.Tensor:
    """The gradient of the loss with respect to the logits of classes ``start:stop``: ``(N, columns)`` in fp32,
    the slice's softmax minus the (smoothed) one-hot target, scaled per token (before any rounding); in
    ``workspace``'s buffers when given."""
    dtype, accumulate, vocab_size = hidden.dtype, lse.dtype, weight.shape[0]
    bias_slice = bias[start:stop].to(dtype) if bias is not None else None
    if workspace is None:
        grad_logits = F.linear(hidden, weight[start:stop].to(dtype), bias_slice).to(accumulate)
    else:  # the same matmul (addmm / mm, as F.linear) into reused buffers
        logits, grad_logits = workspace.views(hidden.shape[0], stop - start)
        weight_t = weight[start:stop].to(dtype).T
        if bias_slice is None:
            torch.mm(hidden, weight_t, out=logits)
        else:
            torch.addmm(bias_slice, hidden, weight_t, out=logits)
        grad_logits.copy_(logits)
    grad_logits.sub_(lse[:, None]).exp_()
    if smoothing:
        grad_logits.sub_(smoothing / vocab_size)
    in_slice = (targets >= start) & (targets < stop) & counted
    hits = torch.where(in_slice, targets - start, torch.zeros_like(targets))
    token_index = torch.arange(targets.shape[0], device=targets.device)
    grad_logits[token_index, hits] -= in_slice.to(accumulate) * (1.0 - smoothing)
    return grad_logits.mul_(scale[:, None])


def _write_weight_slice(
    grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor, start: int, stop: int
) -> None:
    """Rows ``start:stop`` of the weight gradient: one matmul over all tokens, written in place."""
    if grad_weight.dtype == grad_logits.dtype:
        torch.matmul(grad_logits.T, hidden, out=grad_weight[start:stop])
    else:  # autocast: the matmul in its dtype, the gradient in the weight's
        grad_weight[start:stop] = grad_logits.T @ hidden


def _weight_gradient(logits_of: Any, weight: torch.Tensor, hidden: torch.Tensor, columns: int) -> torch.Tensor:
    """The whole weight gradient, a vocabulary slice at a time (the tied embedding's backward calls it)."""
    grad_weight = torch.empty_like(weight)
    workspace = _Workspace.make(hidden, columns, torch.float32)
    for start in _slice_starts(weight.shape[0], columns, hidden):
        stop = min(start + columns, weight.shape[0])
        grad_logits = logits_of(start, stop, workspace)
        _write_weight_slice(grad_weight, _rounded(grad_logits, hidden.dtype, workspace), hidden, start, stop)
    return grad_weight


def _slice_starts(vocab_size: int, columns: int, tensor: torch.Tensor) -> list[int]:
    """Where each vocabulary slice starts. On fake tensors (``estimate_memory``) every slice from the second on
    starts from the same state (the previous slice's small leftovers alive) and, but for the last, allocates and
    frees what the second does, writing into storage that already exists: the first two and the last show the
    loop's peak, so only they run (an 8B Llama's 128k vocabulary at 4096 tokens: 3 slices of 64)."""
    return chunk_starts(vocab_size, columns, tensor)


class _Workspace:
    """The two buffers a vocabulary loop reuses for every slice: its logits in the matmul dtype and in fp32 (on CPU
    a fresh buffer per slice pays its page faults again: ~30 ms per 32 MiB, a tenth of the loss's time)."""

    __slots__ = ("high", "low")

    def __init__(self, hidden: torch.Tensor, columns: int, accumulate: torch.dtype) -> None:
        numel = hidden.shape[0] * columns
        self.low = hidden.new_empty(numel)  # the matmul dtype
        self.high = hidden.new_empty(numel, dtype=accumulate)

    @classmethod
    def make(cls, hidden: torch.Tensor, columns: int, accumulate: torch.dtype) -> _Workspace | None:
        """A workspace for bf16 / fp16 matmuls (``None`` for fp32 / fp64 ones, whose logits need no cast)."""
        return cls(hidden, columns, accumulate) if hidden.dtype != accumulate else None

    def views(self, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, columns)`` contiguous views of both buffers."""
        numel = rows * columns
        return self.low[:numel].view(rows, columns), self.high[:numel].view(rows, columns)


def _rounded(grad_logits: torch.Tensor, dtype: torch.dtype, workspace: _Workspace | None) -> torch.Tensor:
    """``grad_logits`` cast to the matmul dtype (into the workspace's low buffer when there is one)."""
    if workspace is None:
        return grad_logits.to(dtype)
    return workspace.views(*grad_logits.shape)[0].copy_(grad_logits)


def _columns(rows: int, num_tokens: int, vocab_size: int) -> int:
    """Classes per vocabulary slice: a slice holds as many logits as ``rows`` tokens' whole logits."""
    return max(1, min(vocab_size, math.ceil(rows * vocab_size / max(num_tokens, 1))))


def _deliver(tied: TiedGradient | None, grad_weight: torch.Tensor | None) -> torch.Tensor | None:
    """The weight gradient to return: ``None`` once handed to the tied embedding's backward (which returns it)."""
    if tied is None or grad_weight is None:
        return grad_weight
    tied.deliver(grad_weight)
    return None


def _check_targets(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise as ``F.cross_entropy`` does for a class index outside ``[0, V)`` (one min / max; not on fake tensors)."""
    if targets.numel() == 0 or targets.device.type == "meta" or is_fake(targets):
        return
    low, high = (int(value) for value in torch.aminmax(targets))
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise IndexError(
            f"`targets` holds class index {bad}, outside [0, {vocab_size}) for a weight of {vocab_size} classes: "
            f"targets must be class indices or ignore_index={ignore_index} (shifted labels padded with it?)"
        )


def _accumulation_dtype(hidden: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs: what logits, log-sum-exp and gradients are accumulated in."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _autocast_state(device_type: str) -> torch.dtype | None:
    """The autocast dtype active in the forward (the backward runs its matmuls in it too), or ``None``."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _check(
    hidden: Any, weight: Any, targets: Any, bias: Any, reduction: Any, label_smoothing: Any, chunk_size: Any
) -> None:
    for name, value in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"`{name}` must be a tensor, got {type(value).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"`weight` must be (classes, hidden) = 2-D, got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"`hidden` {tuple(hidden.shape)} must end in the weight's hidden size {weight.shape[1]} "
            f"(`weight` is {tuple(weight.shape)}: pass the head's weight as (classes, hidden), like nn.Linear's)"
        )
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"`targets` {tuple(targets.shape)} must have hidden's leading shape {tuple(hidden.shape[:-1])} "
            "(one class index per hidden state; shift them first for a causal LM)"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"`targets` must hold integer class indices, got dtype {targets.dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"`bias` must be a ({weight.shape[0]},) tensor or None, got {shape}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"`reduction`={reduction!r} is not one of {list(REDUCTIONS)}")
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not 0 <= label_smoothing <= 1
    ):
        raise ValueError(f"`label_smoothing`={label_smoothing!r} must be a number in [0, 1]")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(
            f"`chunk_size`={chunk_size!r} must be a positive int (tokens per chunk) or None for the default "
            "(a chunk's logits at most 1/8 of the whole)"
        )
