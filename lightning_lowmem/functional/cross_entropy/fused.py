"""The one-pass path of :func:`~lightning_lowmem.functional.cross_entropy.linear_cross_entropy`: loss and gradients
together, chunk of tokens by chunk of tokens.

Once a chunk's whole logits ``(rows, V)`` are known, so are its log-sum-exp and the gradient of the loss with
respect to them (softmax minus the one-hot target), so the forward computes the gradients of ``hidden``,
``weight`` and ``bias`` for a scalar loss at once and the backward only scales them by ``grad_output``, as
Liger-Kernel's fused linear cross-entropy does. Three matmuls in all, as the unchunked loss (the two-pass
path recomputes the logits in backward: four). The weight gradient is accumulated over the chunks in place, in
the weight's dtype: this path runs for float32 / float64 weights outside autocast (a bf16 weight would round
its gradient once per chunk; those take the two-pass path, which writes each slice of it once).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["fused_loss_and_grads"]


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
    (``None`` where ``needs`` is false), with at most ``rows`` tokens' logits alive at once."""
    num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
    count = counted.sum()
    scale = counted.to(hidden.dtype)  # (N,) d loss / d loss_i
    if reduction == "mean":
        scale = scale / count.clamp(min=1)
    need_hidden, need_weight, need_bias = needs
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros_like(weight) if need_weight else None
    grad_bias = torch.zeros_like(bias) if need_bias and bias is not None else None
    any_grad = need_hidden or need_weight or grad_bias is not None
    losses = hidden.new_empty(num_tokens)
    for start in range(0, num_tokens, rows):
        stop = min(start + rows, num_tokens)
        chunk, chunk_targets = hidden[start:stop], targets[start:stop, None]  # (r, H), (r, 1)
        logits = F.linear(chunk, weight, bias)  # (r, V): the only big tensor
        picked = logits.gather(1, chunk_targets).squeeze(1)
        mean_logit = logits.mean(dim=-1) if smoothing else None
        row_max = logits.amax(dim=-1)
        probs = logits.sub_(row_max[:, None]).exp_()  # in place: exp(z - max)
        total = probs.sum(dim=-1)
        # (1 - eps) * (lse - z_y) + eps * (lse - mean_v z_v): F.cross_entropy's label smoothing
        loss = row_max + total.log() - (1.0 - smoothing) * picked
        losses[start:stop] = loss - smoothing * mean_logit if mean_logit is not None else loss
        if not any_grad:
            continue
        probs.div_(total[:, None])  # softmax, minus the (smoothed) one-hot target:
        if smoothing:
            probs.sub_(smoothing / vocab_size)
        probs.scatter_add_(1, chunk_targets, probs.new_full(chunk_targets.shape, smoothing - 1.0))
        chunk_scale = scale[start:stop, None]  # (r, 1): 0 for ignored targets
        if grad_bias is not None:
            grad_bias.addmv_(probs.T, chunk_scale.squeeze(1))
        if grad_weight is not None:  # (V, H) accumulated in place over the chunks
            grad_weight.addmm_(probs.T, chunk * chunk_scale)
        if grad_hidden is not None:
            torch.mm(probs, weight, out=grad_hidden[start:stop]).mul_(chunk_scale)
        del logits, probs
    total_loss = torch.where(counted, losses, torch.zeros_like(losses)).sum()
    return (total_loss / count if reduction == "mean" else total_loss), [grad_hidden, grad_weight, grad_bias]
