"""Optimizer ``state_dict`` s that load anywhere, and say so when they cannot.

Three transforms on a ``torch.optim.Optimizer.state_dict()`` (no Lightning import):

- **Low-bit state as plain tensors.** torchao keeps 8-/4-bit AdamW moments as tensor subclasses
  (``OptimState8bit``...). Pickled as such they need ``torch.load(weights_only=False)`` or torchao's
  safe-globals registration (done only once ``torchao.optim`` is imported), and they cannot be rebuilt
  under Lightning's callable ``map_location``. :func:`flatten_low_bit_state` stores each one as a dict of
  plain tensors (``codes``, ``scale``, ``qmap``) plus its attributes; :func:`unflatten_low_bit_state`
  rebuilds it (only the torchao classes listed in :data:`LOW_BIT_CLASSES`).
- **A marker a plain optimizer rejects.** :func:`mark_state_dict` moves each parameter's ``step`` to
  ``lowmem_step`` and puts a ``bytes`` message in ``step``: torch's Adam / AdamW / Adafactor (and the
  others that keep a ``step``) call ``float(state["step"])`` while loading, which fails with that message
  ("could not convert string to float: b'lightning_lowmem: ... add MemoryEfficientOptimizer(...)'").
  ``bytes`` survives ``Optimizer.load_state_dict``'s deep copy (a ``str`` would not).
  :func:`unmark_state_dict` undoes it.
- **What kind of state it is.** :func:`state_family` reads a per-parameter state's keys (``adam``,
  ``adafactor``, ``sgd``) and :func:`low_bit_kinds` the quantized formats in it, so a loading optimizer can
  refuse state written by another one before anything is applied.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = [
    "LOW_BIT_CLASSES",
    "MARKED_STEP_KEY",
    "flatten_low_bit_state",
    "is_marked",
    "low_bit_kinds",
    "mark_state_dict",
    "normalize_loaded_state",
    "state_family",
    "unflatten_low_bit_state",
    "unmark_state_dict",
]

LOW_BIT_KEY = "lowmem_low_bit_state"
"""Key marking a dict as a flattened low-bit optimizer state tensor (its value: the class path)."""

LOW_BIT_CLASSES = {
    "torchao.optim.subclass_8bit.OptimState8bit": "8bit",
    "torchao.optim.subclass_4bit.OptimState4bit": "4bit",
    "torchao.optim.subclass_fp8.OptimStateFp8": "fp8",
}
"""The tensor subclasses :func:`unflatten_low_bit_state` rebuilds (class path -> kind)."""

MARKED_STEP_KEY = "lowmem_step"
"""Where :func:`mark_state_dict` keeps a parameter's real ``step``."""

_FAMILIES = {
    "adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"),
    "adafactor": ("row_var", "col_var", "variance", "step"),
    "sgd": ("momentum_buffer",),
}


def _class_path(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _map_param_states(state_dict: dict[str, Any], fn: Any) -> dict[str, Any]:
    """A shallow copy of ``state_dict`` with ``fn`` applied to each per-parameter state dict."""
    states = state_dict.get("state")
    if not isinstance(states, dict):
        return state_dict
    return {**state_dict, "state": {k: fn(v) if isinstance(v, dict) else v for k, v in states.items()}}


def flatten_low_bit_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Replace every torchao low-bit state tensor in ``state_dict`` by a dict of plain tensors.

    The live optimizer state is not changed (new dicts are built). Usable as an optimizer
    ``register_state_dict_post_hook``.

    Example::

        >>> param = torch.nn.Parameter(torch.randn(64, 64))
        >>> from lightning_lowmem.functional.optimizers.catalog import build_optimizer
        >>> opt = build_optimizer("adamw", [param])
        >>> flatten_low_bit_state(opt.state_dict()) == opt.state_dict()   # nothing low-bit: unchanged
        True
    """

    def flatten(state: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in state.items():
            path = _class_path(value)
            if isinstance(value, torch.Tensor) and path in LOW_BIT_CLASSES:
                names, attributes = value.__tensor_flatten__()
                out[key] = {
                    LOW_BIT_KEY: path,
                    "tensors": {n: getattr(value, n) for n in names},
                    "attributes": list(attributes),
                }
            else:
                out[key] = value
        return out

    return _map_param_states(state_dict, flatten)


def unflatten_low_bit_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Rebuild the low-bit state tensors :func:`flatten_low_bit_state` stored as plain tensors.

    Raises:
        ValueError: a flattened entry names a class outside :data:`LOW_BIT_CLASSES`.
        ImportError: torchao is missing (with the install command).
    """

    def unflatten(state: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in state.items():
            if isinstance(value, dict) and LOW_BIT_KEY in value:
                path = value[LOW_BIT_KEY]
                if path not in LOW_BIT_CLASSES:
                    raise ValueError(
                        f"optimizer state entry {key!r} names {path!r}; only {sorted(LOW_BIT_CLASSES)} are rebuilt"
                    )
                module_name, _, class_name = path.rpartition(".")
                try:
                    cls = getattr(importlib.import_module(module_name), class_name)
                except ImportError as err:
                    raise ImportError(f"this optimizer state holds {class_name} tensors: pip install torchao") from err
                out[key] = cls.__tensor_unflatten__(dict(value["tensors"]), list(value["attributes"]), None, None)
            else:
                out[key] = value
        return out

    return _map_param_states(state_dict, unflatten)


def mark_state_dict(state_dict: dict[str, Any], message: str) -> dict[str, Any]:
    """Put ``message`` where a plain torch optimizer reads ``step``; the real step moves to ``lowmem_step``.

    Only states holding a ``step`` are marked (torch's SGD keeps none and would load the state as is).

    Example::

        >>> param = torch.nn.Parameter(torch.randn(4)); param.grad = torch.ones(4)
        >>> opt = torch.optim.AdamW([param]); opt.step()
        >>> marked = mark_state_dict(opt.state_dict(), "lightning_lowmem: add MyCallback")
        >>> torch.optim.AdamW([param]).load_state_dict(marked)
        Traceback (most recent call last):
        ...
        ValueError: could not convert string to float: b'lightning_lowmem: add MyCallback'
        >>> torch.optim.AdamW([param]).load_state_dict(unmark_state_dict(marked))   # loads again
    """
    payload = message.encode()

    def mark(state: dict[str, Any]) -> dict[str, Any]:
        if "step" not in state or MARKED_STEP_KEY in state:
            return state
        return {**state, MARKED_STEP_KEY: state["step"], "step": payload}

    return _map_param_states(state_dict, mark)


def is_marked(state_dict: dict[str, Any]) -> bool:
    """True when some parameter state of ``state_dict`` carries :func:`mark_state_dict`'s marker."""
    states = state_dict.get("state") if isinstance(state_dict, dict) else None
    return isinstance(states, dict) and any(isinstance(s, dict) and MARKED_STEP_KEY in s for s in states.values())


def unmark_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Undo :func:`mark_state_dict` (states without the marker are left as they are)."""

    def unmark(state: dict[str, Any]) -> dict[str, Any]:
        if MARKED_STEP_KEY not in state:
            return state
        out = {k: v for k, v in state.items() if k != MARKED_STEP_KEY}
        out["step"] = state[MARKED_STEP_KEY]
        return out

    return _map_param_states(state_dict, unmark)


def normalize_loaded_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """:func:`unmark_state_dict` then :func:`unflatten_low_bit_state`: what this package's optimizers load."""
    return unflatten_low_bit_state(unmark_state_dict(state_dict))


def state_family(state: dict[str, Any]) -> str:
    """``"adam"``, ``"adafactor"``, ``"sgd"`` or ``"unknown"``, from one parameter's state keys."""
    keys = {k for k in state if k != MARKED_STEP_KEY}
    for family, allowed in _FAMILIES.items():
        if keys and keys <= set(allowed) and (family != "adafactor" or keys & {"row_var", "variance"}):
            if family != "adam" or "exp_avg" in keys:
                return family
    return "unknown"


def low_bit_kinds(state: dict[str, Any]) -> set[str]:
    """The low-bit formats (``"8bit"``, ``"4bit"``, ``"fp8"``) in one parameter's state, flattened or live."""
    kinds = set()
    for value in state.values():
        if isinstance(value, dict) and value.get(LOW_BIT_KEY) in LOW_BIT_CLASSES:
            kinds.add(LOW_BIT_CLASSES[value[LOW_BIT_KEY]])
        elif isinstance(value, torch.Tensor) and _class_path(value) in LOW_BIT_CLASSES:
            kinds.add(LOW_BIT_CLASSES[_class_path(value)])
    return kinds
