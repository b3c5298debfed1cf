"""The batch's values inside a fake step: the answers a real step gets to questions about its mask.

Hugging Face models before transformers 5 ask *value* questions while building their attention mask:
``padding_mask.all()`` (4.x ``masking_utils``), ``torch.all(mask == 1)`` (BERT's SDPA path, even for the
all-ones mask it makes itself when the batch has none). The answer decides whether a mask is built at all,
and so which attention kernel runs; a fake tensor cannot give it (``aten._local_scalar_dense``).
transformers 5 skips those questions for fake tensors (it treats them as tracing).

Only the model is fake; the batch is real. :class:`BatchValues` keeps a real CPU copy of each batch tensor
beside its fake twin, runs every op whose tensor inputs are all known (and whose outputs are small: masks,
positions, labels -- never activations) on the real copies too, and answers a value question about a known
tensor with the real answer. A question about anything else (an activation, a parameter) still raises and
becomes an :class:`~lightning_lowmem.planning._fake_step.EstimationError`. A batch on ``meta`` has no values:
its masks (tensors under a key with ``mask`` in its name, e.g. ``attention_mask``) count as all ones -- no token
padded, as :func:`~lightning_lowmem.planning.attention.batch_is_padded` takes them, so an all-ones mask makes the
same choices (mask or none, attention kernel) whether it is given as a real tensor or on ``meta`` -- and its
other tensors as zeros.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary


from lightning_lowmem._compat import TorchDispatchMode, tree_flatten, tree_leaves, tree_unflatten
from lightning_lowmem._compat.fake_mode import no_dispatch_modes, op_mutates

# outputs with more elements than this are left unknown (a (B, 1, T, T) mask of a long sequence, activations)
KNOWN_NUMEL_LIMIT = 1 << 22
_VALUE_QUESTIONS = (
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
)


class BatchValues(TorchDispatchMode):
    """Inside a FakeTensorMode: track the real values of the batch and of what is computed from it alone.

    Args:
        real_batch: the batch as given (tensors on any device, or ``meta``).
        fake_batch: the same batch made fake (:func:`~lightning_lowmem.planning._fake_step.fake_batch`).

    Example::

        >>> from lightning_lowmem._compat.fake_mode import fake_tensor_mode
        >>> mask = torch.ones(2, 4, dtype=torch.long)
        >>> with fake_tensor_mode():
        ...     fake = torch.empty(2, 4, dtype=torch.long)
        ...     with BatchValues(mask, fake):
        ...         bool(fake.to(torch.bool).all())
        True
    """

    def __init__(self, real_batch: Any, fake_batch: Any) -> None:
        super().__init__()
        self.known = WeakTensorKeyDictionary()  # fake tensor -> its real CPU value
        masks = _masks(real_batch)
        with no_dispatch_modes():  # real copies, even when made inside the fake mode
            for real, fake in zip(tree_leaves(real_batch), tree_leaves(fake_batch), strict=True):
                if not (isinstance(real, torch.Tensor) and isinstance(fake, torch.Tensor)):
                    continue
                if real.numel() > KNOWN_NUMEL_LIMIT:
                    continue
                if real.device.type == "meta":  # no values: a mask unpadded, anything else zeros (module docstring)
                    fill = torch.ones if id(real) in masks else torch.zeros
                    self.known[fake] = fill(real.shape, dtype=fake.dtype)
                else:
                    self.known[fake] = real.detach().to("cpu", fake.dtype, copy=True)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        unknown = self._first_unknown(args, kwargs)
        if unknown is not None:  # the common case (an activation, a parameter): nothing to learn, one lookup
            out = func(*args, **kwargs)
            if _mutates(func):  # written with values we do not know: forget them rather than be stale
                for tensor in tree_leaves((args, kwargs)):
                    if isinstance(tensor, torch.Tensor):
                        self.known.pop(tensor, None)
            return out
        flat, spec = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        known = all(t in self.known or _literal(t) for t in tensors)
        if func in _VALUE_QUESTIONS and tensors and known:
            answer = self._real(func, flat, spec)  # the real step's answer
            if answer is not None:
                return answer
        out = func(*args, **kwargs)
        if not known:
            if _mutates(func):  # written with values we do not know: forget them rather than be stale
                for tensor in tensors:
                    self.known.pop(tensor, None)
            return out
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outs and all(t.numel() <= KNOWN_NUMEL_LIMIT for t in outs):
            real_out = self._real(func, flat, spec)  # in place on the real copies too, for a mutating op
            real_outs = (
                [t for t in tree_leaves(real_out) if isinstance(t, torch.Tensor)] if real_out is not None else []
            )
            if len(real_outs) == len(outs):
                for fake, real in zip(outs, real_outs, strict=True):
                    self.known[fake] = real
                return out
        for tensor in outs + (tensors if _mutates(func) else []):  # too large, or failed for real
            self.known.pop(tensor, None)
        return out

    def _first_unknown(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """A tensor argument whose value is not known (none: every tensor argument is known, or a literal); looked
        for without pytree's overhead in the flat tensors and lists of them an op takes (anything else: pytree)."""
        for value in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(value, torch.Tensor):
                if value not in self.known and not _literal(value):
                    return value
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, torch.Tensor) and item not in self.known and not _literal(item):
                        return item
        return None

    def _real(self, func: Any, flat: list[Any], spec: Any) -> Any:
        """``func`` on the real values, outside every mode (not counted, not fake); ``None`` if it fails
        there (e.g. a factory asking for a device this machine lacks)."""
        real_flat = [self.known[t] if isinstance(t, torch.Tensor) and not _literal(t) else t for t in flat]
        real_args, real_kwargs = tree_unflatten(real_flat, spec)
        with no_dispatch_modes():
            try:
                return func(*real_args, **real_kwargs)
            except Exception:  # noqa: BLE001 - unknown from here on: a value question about it raises as before
                return None


_MUTATES: dict[Any, bool] = {}


def _mutates(func: Any) -> bool:
    """:func:`op_mutates`, asked once per op overload."""
    answer = _MUTATES.get(func)
    if answer is None:
        answer = _MUTATES[func] = op_mutates(func)
    return answer


def _literal(tensor: torch.Tensor) -> bool:
    """A real CPU tensor inside the fake step: a literal the model wrote (``torch.tensor([-1, 0])``), its value known."""
    return type(tensor) is torch.Tensor and tensor.device.type == "cpu"  # exactly a Tensor: not fake, no subclass


def _masks(batch: Any, under_mask: bool = False) -> set[int]:
    """The ids of the tensors under a dict key naming a mask (``attention_mask``, ``decoder_attention_mask``...)."""
    if isinstance(batch, torch.Tensor):
        return {id(batch)} if under_mask else set()
    if isinstance(batch, dict):
        return {i for key, value in batch.items() for i in _masks(value, under_mask or "mask" in str(key))}
    if isinstance(batch, (list, tuple)):
        return {i for value in batch for i in _masks(value, under_mask)}
    return set()
