"""One gradient buffer for a weight shared by the input embedding and the output head (tied embeddings).

Left to autograd, a tied weight gets two dense ``(V, H)`` gradients: the loss's (the head's) and the embedding
lookup's (``embedding_dense_backward``), summed into one before the weight's ``.grad`` is set. Under
:func:`~lightning_lowmem.functional.cross_entropy.chunk_cross_entropy_` the tied embedding runs
:class:`_TiedEmbedding` instead: the chunked loss hands its weight gradient to the embedding's backward (a
:class:`TiedGradient` made by the embedding's forward and claimed by the loss's), which adds its rows into that
buffer in place (``index_add_``) and returns it as the weight's only gradient. Autograd then sets ``.grad`` to
it without a copy, and a post-accumulate-grad hook (an optimizer in backward) runs once, on the whole gradient.
The bf16 / fp16 (and autocast) loss defers its weight gradient to the embedding's backward
(:meth:`TiedGradient.deliver_later`): the buffer is made after the body's backward, so it is never alive beside a
layer's backward temporaries; the logits are recomputed there a slice at a time (as they would be in the loss's
backward), the gradient bit-identical.

The loss claims the buffer only when the embedding's backward is sure to run after its own: the embedding's
autograd node is reachable from the hidden states' (checked once per forward by walking the graph). Otherwise
(a detached body, a second loss on the same forward) the loss returns its gradient to autograd as usual.

A dispatch-mode meter sees the same allocations as a run without one: with two gradients per weight, autograd
sums them out of place whenever a ``TorchDispatchMode`` is active (its ``isTensorSubclassLike`` check), one
``(V, H)`` buffer more than the run it measures; with one gradient there is no sum to make.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["TiedGradient", "claim", "pending", "tie_embedding_gradient_", "tied_embeddings"]

_PENDING: dict[int, "weakref.ref[TiedGradient]"] = {}  # id(weight) -> the latest embedding use's buffer


class TiedGradient:
    """The gradient buffer one embedding lookup shares with the loss that claimed it (one per forward)."""

    __slots__ = ("__weakref__", "buffer", "claimed", "later", "node", "weight")

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weakref.ref(weight)
        self.buffer: torch.Tensor | None = None  # the loss's weight gradient, once its backward ran
        self.later: list[Callable[[], torch.Tensor]] = []  # weight gradients the embedding's backward computes
        self.claimed = False
        self.node: Any = None  # a weak reference to the embedding's autograd node (which holds this object)

    def deliver(self, gradient: torch.Tensor) -> None:
        """The loss's weight gradient: kept for the embedding's backward to complete and return."""
        self.buffer = gradient if self.buffer is None else self.buffer.add_(gradient)

    def deliver_later(self, compute: Callable[[], torch.Tensor]) -> None:
        """The loss's weight gradient as a function the embedding's backward calls (after the body's backward):
        the ``(V, H)`` buffer is then not alive while the body's gradients are computed."""
        self.later.append(compute)

    def take(self) -> torch.Tensor | None:
        """The loss's weight gradient (computing the deferred ones now), or ``None`` if none was delivered."""
        later, self.later = self.later, []
        for compute in later:
            self.deliver(compute())
        buffer, self.buffer = self.buffer, None
        return buffer


def claim(weight: torch.Tensor, hidden: torch.Tensor) -> TiedGradient | None:
    """The buffer of ``weight``'s latest embedding lookup, if ``hidden`` depends on that lookup and no loss has
    claimed it yet; ``None`` (the loss returns its gradient to autograd) otherwise."""
    ref = _PENDING.get(id(weight))
    shared = ref() if ref is not None else None
    if shared is None or shared.claimed or shared.weight() is not weight or shared.node is None:
        return None
    node = shared.node()
    if node is None or not _reaches(hidden.grad_fn, node):
        return None
    shared.claimed = True
    return shared


def pending(weight: torch.Tensor) -> bool:
    """Whether an embedding lookup of ``weight`` waits for a loss to claim its buffer (without claiming it)."""
    ref = _PENDING.get(id(weight))
    shared = ref() if ref is not None else None
    return shared is not None and not shared.claimed and shared.weight() is weight


def _reaches(start: Any, target: Any) -> bool:
    """Whether autograd node ``target`` is reachable from ``start`` (an iterative walk of the graph)."""
    seen: set[int] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if node is target:
            return True
        seen.add(id(node))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


class _TiedEmbedding(torch.autograd.Function):
    """``F.embedding`` whose backward adds its rows into the loss's weight gradient (or a zero buffer) in place."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, shared: TiedGradient
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.shared = padding_idx, shared
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        shared: TiedGradient = ctx.shared
        buffer = shared.take()
        if buffer is None:  # no loss delivered (not claimed, or its weight gradient was not needed)
            buffer = grad_output.new_zeros(ctx.weight_shape, dtype=ctx.weight_dtype)
        flat_ids = ids.reshape(-1)
        rows = grad_output.reshape(-1, grad_output.shape[-1]).to(buffer.dtype)  # (N, H)
        if ctx.padding_idx is not None:  # F.embedding's padding row gets no gradient
            rows = rows.masked_fill((flat_ids == ctx.padding_idx)[:, None], 0)
        buffer.index_add_(0, flat_ids, rows)
        return None, buffer, None, None


def tied_embeddings(module: nn.Module, weight: torch.Tensor) -> list[tuple[str, nn.Embedding]]:
    """The plain ``nn.Embedding`` modules of ``module`` whose weight is ``weight`` (tied to the head)."""
    return [
        (name, sub)
        for name, sub in module.named_modules()
        if isinstance(sub, nn.Embedding)
        and sub.weight is weight
        and type(sub).forward is nn.Embedding.forward
        and sub.max_norm is None
        and not sub.sparse
        and not sub.scale_grad_by_freq
    ]


def tie_embedding_gradient_(embedding: nn.Embedding) -> Callable[[], None]:
    """Make ``embedding`` share its weight gradient with a chunked loss in training; returns the undo."""

    def forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not (self.training and torch.is_grad_enabled() and weight.requires_grad):
            return nn.Embedding.forward(self, ids)
        shared = TiedGradient(weight)
        out = _TiedEmbedding.apply(ids, weight, self.padding_idx, shared)
        shared.node = weakref.ref(out.grad_fn)
        _PENDING[id(weight)] = weakref.ref(shared)
        return out

    embedding.forward = types.MethodType(forward, embedding)  # type: ignore[method-assign]
    return lambda: embedding.__dict__.pop("forward", None)
