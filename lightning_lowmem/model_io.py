"""How lightning_lowmem calls a user's model on a batch: Hugging Face conventions and one override point.

Whenever the package must run the model itself (PTQ latency timing and calibration, a teacher's logits,
``estimate_memory``'s default step for a plain module), it goes through :func:`forward_batch`:

* A module that defines ``forward_batch(self, batch)`` is called through it. That is the **one documented
  override point**: the user's own answer to "run the model on one batch". Return the model output (a
  tensor, a ``ModelOutput`` or a dict with ``logits``). (``predict_step`` is not used: it often returns
  predictions such as ``argmax`` ids rather than the model output.)
* Otherwise the batch is unpacked by convention: a mapping (``dict``, Hugging Face ``BatchEncoding``) is
  passed as keywords, ``model(**batch)``; a tuple / list is the ``(inputs, targets)`` convention,
  ``model(batch[0])``; a tensor is passed as it is. The call is checked against ``forward``'s signature
  first, so a batch the model cannot take gets an error naming the override point instead of a guess that
  crashes deep inside the model.

Outputs are read the Hugging Face way: :func:`output_logits` takes ``.logits`` of a ``ModelOutput`` /
dict, the first tensor of a tuple, or the tensor itself; :func:`output_loss` takes ``.loss``.

This module imports neither Lightning nor the package's transforms, so every layer may use it.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Iterable

import torch
from torch import nn
from lightning_lowmem._compat import tree_leaves

from lightning_lowmem.warnings import LowMemWarning

__all__ = [
    "BatchCallError",
    "batch_size",
    "describe_batch",
    "disable_kv_cache_",
    "forward_batch",
    "model_inputs",
    "output_logits",
    "output_loss",
    "restore_kv_cache_",
    "has_forward_batch",
    "tensor_leaves",
]

OVERRIDE_HINT = (
    "define `forward_batch(self, batch)` on your LightningModule returning the model output for one batch "
    "(lightning_lowmem calls it whenever it must run the model itself)"
)


class BatchCallError(TypeError):
    """The model cannot be called with a batch by convention; the message names the override point."""


def tensor_leaves(batch: Any) -> list[torch.Tensor]:
    """Every tensor inside ``batch`` (dicts, tuples, lists, ``BatchEncoding`` ...)."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)  # BatchEncoding & co. are Mappings pytree does not know
    return [leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)]


def batch_size(batch: Any) -> int | None:
    """The size of dim 0 shared by every tensor of ``batch`` with a dim, or ``None`` if they disagree."""
    sizes = {leaf.shape[0] for leaf in tensor_leaves(batch) if leaf.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def model_inputs(batch: Any, drop_keys: Iterable[str] = ()) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The ``(args, kwargs)`` a model takes for ``batch`` by convention (see the module docstring).

    Args:
        batch: a mapping, a tuple / list ``(inputs, targets, ...)`` or a tensor.
        drop_keys: mapping keys left out (e.g. ``("labels",)`` so a Hugging Face model skips its loss).
            Default: none.

    Example::

        >>> ids = torch.zeros(2, 4, dtype=torch.long)
        >>> model_inputs({"input_ids": ids, "labels": ids}, drop_keys=("labels",))[1].keys()
        dict_keys(['input_ids'])
        >>> len(model_inputs((ids, ids))[0])
        1
    """
    if isinstance(batch, Mapping):
        dropped = set(drop_keys)
        return (), {key: value for key, value in batch.items() if key not in dropped}
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise BatchCallError(f"the batch is an empty {type(batch).__name__}; {OVERRIDE_HINT}")
        return (batch[0],), {}
    return (batch,), {}


def has_forward_batch(module: nn.Module) -> bool:
    """True when ``module`` defines the override point ``forward_batch(self, batch)``."""
    return callable(getattr(module, "forward_batch", None))


def check_signature(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batch: Any) -> None:
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # builtins / C extensions: let the call itself decide
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        raise BatchCallError(
            f"lightning_lowmem could not call {type(module).__name__}.forward{signature} with a batch of "
            f"{describe_batch(batch)} ({err}): by convention a dict batch is passed as keywords, a tuple / list "
            f"as its first element. To tell it how, {OVERRIDE_HINT}."
        ) from None


def forward_batch(module: nn.Module, batch: Any, *, drop_keys: Iterable[str] = ()) -> Any:
    """Run ``module`` on one ``batch`` the way its owner does (see the module docstring).

    Args:
        module: any ``nn.Module``; its ``forward_batch(batch)`` is used when it defines one.
        batch: one batch, already on the module's device.
        drop_keys: mapping keys not passed by convention (``forward_batch`` gets the whole batch). Default: none.

    Returns:
        Whatever the model returns (use :func:`output_logits` / :func:`output_loss` to read it).

    Raises:
        BatchCallError: the batch does not fit ``forward``'s signature; the message names the override point.

    Example::

        >>> model = nn.Linear(4, 2)
        >>> forward_batch(model, (torch.ones(3, 4), torch.zeros(3))).shape
        torch.Size([3, 2])
    """
    if has_forward_batch(module):
        return module.forward_batch(batch)  # type: ignore[operator]
    args, kwargs = model_inputs(batch, drop_keys)
    check_signature(module, args, kwargs, batch)
    return module(*args, **kwargs)


def output_logits(output: Any) -> torch.Tensor:
    """The logits (or plain output tensor) of a model output: ``.logits`` / ``["logits"]``, a tuple's first tensor
    (deferred logits of the chunked loss count as logits).

    Raises:
        TypeError: no tensor could be found (names the type received and the override point).
    """
    if isinstance(output, torch.Tensor) or _deferred(output):
        return output
    if isinstance(output, Mapping):  # ModelOutput is an OrderedDict
        if isinstance(output.get("logits"), torch.Tensor) or _deferred(output.get("logits")):
            return output["logits"]
        for key, value in output.items():
            if key != "loss" and isinstance(value, torch.Tensor):
                return value
    if isinstance(output, (tuple, list)):
        for value in output:
            if isinstance(value, torch.Tensor):
                return value
    raise TypeError(
        f"cannot find the logits in a model output of type {type(output).__name__}: expected a tensor, a mapping / "
        f"ModelOutput with `logits`, or a tuple starting with a tensor; {OVERRIDE_HINT}"
    )


def _deferred(value: Any) -> bool:
    """Logits the chunked loss left uncomputed (``functional.cross_entropy.DeferredLogits``, told by a class marker
    so this module imports no transform): they stand for the logits they defer."""
    return bool(getattr(type(value), "defers_logits", False))


def output_loss(output: Any) -> torch.Tensor | None:
    """``output.loss`` / ``output["loss"]`` when present (Hugging Face models given ``labels``), else ``None``."""
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def describe_batch(batch: Any) -> str:
    """A short description of a batch's structure, e.g. ``dict(input_ids: (8, 64) int64, labels: ...)``."""

    def describe(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        return type(value).__name__

    if isinstance(batch, Mapping):
        return "dict(" + ", ".join(f"{key}: {describe(value)}" for key, value in batch.items()) + ")"
    if isinstance(batch, (tuple, list)):
        return f"{type(batch).__name__}(" + ", ".join(describe(value) for value in batch) + ")"
    return describe(batch)


# ----------------------------------------------------------------------------- the KV cache while training
_KV_CACHE_HOLDS: dict[int, tuple[Any, set[str]]] = {}  # id(config) -> (weakref to it, reasons holding it off)


def _holders(config: Any) -> set[str] | None:
    hold = _KV_CACHE_HOLDS.get(id(config))  # by id: configs define __eq__ and are unhashable
    if hold is not None and hold[0]() is not config:  # a dead config's id, reused
        del _KV_CACHE_HOLDS[id(config)]
        return None
    return hold[1] if hold is not None else None


def _configs_with_cache(module: nn.Module) -> list[tuple[str, str, Any]]:
    """(module name, its class name, its config) of each model inside ``module`` with a ``use_cache`` flag."""
    found: dict[int, tuple[str, str, Any]] = {}
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if config is not None and isinstance(getattr(config, "use_cache", None), bool):
            found.setdefault(id(config), (name, type(sub).__name__, config))
    return list(found.values())


def disable_kv_cache_(module: nn.Module, reason: str = "activation checkpointing") -> list[str]:
    """Set ``config.use_cache = False`` on every Hugging Face model inside ``module`` while ``reason`` holds it.

    A causal LM in training mode still builds its generation KV cache, which keeps every layer's keys
    and values alive until the output is freed: it undoes activation checkpointing and compression
    (GPT-2: +37% peak, Llama: +50% against Hugging Face's own ``gradient_checkpointing_enable()``, which
    turns it off too). Each ``reason`` (a technique) holds the cache off until
    ``restore_kv_cache_(module, reason)``; the original value comes back when the last reason lets go.
    Warns (:class:`LowMemWarning`) when it switches a value off, so once per model and run.

    Args:
        module: the model (a LightningModule holding a ``transformers`` model, or the model itself).
        reason: the technique that needs it, e.g. ``"activation compression"``. Default:
            ``"activation checkpointing"``.

    Returns:
        The names of the submodules whose config this call switched off (``""``: ``module`` itself).

    Example::

        >>> from lightning_lowmem.models.hf import build_hf_model
        >>> model = build_hf_model("gpt2")
        >>> with warnings.catch_warnings(record=True):
        ...     disable_kv_cache_(model), model.config.use_cache
        ([''], False)
        >>> restore_kv_cache_(model), model.config.use_cache
        ([''], True)
    """
    changed, owners = [], []
    for name, owner, config in _configs_with_cache(module):
        holders = _holders(config)
        if holders is None:
            if not config.use_cache:
                continue  # off already, by the user: nothing to restore
            holders = set()
            _KV_CACHE_HOLDS[id(config)] = (weakref.ref(config), holders)
            config.use_cache = False
            changed.append(name)
            owners.append(owner)
        holders.add(reason)
    if changed:
        warnings.warn(
            f"{owners[0]}.config.use_cache=True builds a generation KV cache during training, which keeps every layer's "
            f"keys and values alive and undoes {reason}; lightning_lowmem sets use_cache=False while it runs and "
            "restores it afterwards (set it to False yourself to silence this).",
            LowMemWarning,
            stacklevel=2,
        )
    return changed


def restore_kv_cache_(module: nn.Module, reason: str = "activation checkpointing") -> list[str]:
    """Let go of ``reason``'s hold (see :func:`disable_kv_cache_`); returns the names whose cache came back on."""
    restored = []
    for name, _, config in _configs_with_cache(module):
        holders = _holders(config)
        if holders is None:
            continue
        holders.discard(reason)
        if not holders:
            config.use_cache = True
            del _KV_CACHE_HOLDS[id(config)]
            restored.append(name)
    return restored
