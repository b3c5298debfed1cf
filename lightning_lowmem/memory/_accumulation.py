"""Autograd's gradient sums, which any dispatch mode makes out of place: told apart, so the meter books them in place.

When two gradients reach the same input of a backward node (a tied weight: the output head's and the embedding's;
a tensor used twice), autograd's engine adds them in that node's input buffer. Without a dispatch mode it adds the
second into the first **in place** when it holds the only reference to the first and the first is a plain dense
tensor, not a view (``torch/csrc/autograd/input_buffer.cpp``: ``accumulate``, ``can_accumulate_inplace``). Under any
``TorchDispatchMode`` (the memory tracker, FakeTensorMode) ``at::isTensorSubclassLike`` answers yes for every tensor
(``ATen/TensorSubclassLikeUtils.h``: ``if (c10::impl::dispatch_mode_enabled()) return true;``), so the engine adds
out of place: one more gradient-sized buffer is alive than the run without a meter ever holds, and the first is
freed right after. A Python mode cannot change the engine's choice, so the tracker books the sum as autograd makes
it without a mode: :func:`first_of_engine_sum` recognises the sum (an ``add`` that autograd's engine itself called
in backward, with grad mode off, on two plain tensors of one shape and dtype, the first dense and not a view), and
the tracker holds the sum's allocation back until the next event. When that event is the first gradient being
freed (the engine held its last reference: without a mode it would have added in place), the sum takes over the
first's bytes; anything else and the sum is counted as the allocation it is.

Example: a tied model under ``bf16-mixed`` (the head's fp32 gradient comes from autocast's cast, a plain tensor):
a run without a meter peaks with two (V, H) fp32 buffers, the meter used to read three. Under ``32-true`` the
head's gradient is a transposed view of its matmul's result, so autograd adds out of place there too, and both
read three.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_lowmem._compat.autograd import dispatched_by_autograd_engine, view_base
from lightning_lowmem.memory._tensors import is_plain

_ADD = torch.ops.aten.add.Tensor


def first_of_engine_sum(func: Any, args: tuple, kwargs: dict, caller: Any) -> torch.Tensor | None:
    """The first gradient when ``func(*args, **kwargs)`` is autograd's sum of two gradients that it adds in place
    without a dispatch mode, provided it holds the last reference to that first gradient; else ``None``.

    Call it only in backward; ``caller`` is the frame that called ``__torch_dispatch__``.
    """
    if func is not _ADD or len(args) != 2 or kwargs.get("alpha", 1) != 1 or torch.is_grad_enabled():
        return None
    first, second = args
    if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)):
        return None
    if not (is_plain(first) and is_plain(second)) or first.layout != torch.strided or second.layout != torch.strided:
        return None
    if first.shape != second.shape or first.dtype != second.dtype or first.is_nested or view_base(first) is not None:
        return None
    if not _dense(first) or not dispatched_by_autograd_engine(caller):
        return None
    return first


class EngineSums:
    """The part of :class:`~lightning_lowmem.memory._tracker.StorageTracker` that books autograd's sums in place:
    the tracker holds a sum back (``_hold_sum``), then either its first gradient is freed next (``_sum_in_place``)
    or anything else happens first and the sum is counted (``_count_held_sum``, called on every event)."""

    def _hold_sum(self, out: Any, first: torch.Tensor) -> bool:
        """Hold back the allocation of ``out``, autograd's sum of ``first`` and another gradient."""
        if not isinstance(out, torch.Tensor) or not is_plain(out) or out.shape != first.shape:
            return False
        out_key, first_key = self._key(out), self._key(first)
        if out_key is None or out_key in self._records or first_key not in self._records:
            return False
        nbytes = self._storage_bytes(out)
        if nbytes != self._records[first_key].nbytes:
            return False
        self._held_sum = (out_key, first_key, nbytes)
        return True

    def _sum_in_place(self) -> None:
        """The first gradient freed right after the sum: the sum lives in its bytes, as autograd adds without a mode."""
        out_key, first_key, _ = self._held_sum
        self._held_sum = None
        self._records[out_key] = self._records.pop(first_key)
        self._refs.pop(first_key, None)

    def _count_held_sum(self, in_callback: bool = False) -> None:
        """Something else happened first: the held sum is a new allocation (its first gradient lives on), counted now.

        Inside a weakref callback (another storage freed), an error (``MemoryLimitExceeded``) cannot propagate: it is
        kept in ``_callback_error`` for the next op to raise.
        """
        if self._held_sum is None:
            return
        out_key, _, nbytes = self._held_sum
        self._held_sum = None
        try:
            self._allocate_bytes(out_key, nbytes)
        except Exception as error:
            if not in_callback:
                raise
            self._callback_error = error


def _dense(tensor: torch.Tensor) -> bool:
    """The tensor covers its whole storage, each element once (non-overlapping and dense, no offset)."""
    if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return False
    return tensor.numel() <= 1 or all(
        stride != 0 for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1
    )
