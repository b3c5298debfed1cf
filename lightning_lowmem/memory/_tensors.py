"""Which plain tensors an object holds: op arguments, pytrees, tensor subclasses, optimizer state.

The memory tracker asks this for every op it sees, so the common cases (flat tensors, lists of them)
avoid pytree's overhead; tensor subclasses (quantized weights, torchao's low-bit optimizer state) are
opened through ``__tensor_flatten__`` down to the tensors that own storage.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from lightning_lowmem._compat.fake_mode import is_fake
from lightning_lowmem._compat import tree_flatten


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Plain tensors inside ``obj`` (pytrees; tensor subclasses are opened via ``__tensor_flatten__``)."""
    if isinstance(obj, torch.Tensor):
        yield from plain_tensors(obj)
    elif isinstance(obj, (list, tuple)):  # the common containers, walked without pytree's overhead:
        for item in obj:  # MemoryMonitor calls this every logged step
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif obj is not None and not isinstance(obj, (int, float, bool, str)):
        leaves, _ = tree_flatten(obj)
        if len(leaves) != 1 or leaves[0] is not obj:
            for leaf in leaves:
                yield from iter_tensors(leaf)


_PLAIN_TYPES: set[type] = {torch.Tensor, nn.Parameter}
"""Tensor types that hold their own storage (FakeTensor joins on first sight: see ``is_plain``)."""


def is_plain(tensor: torch.Tensor) -> bool:
    kind = type(tensor)
    if kind in _PLAIN_TYPES:
        return True
    if is_fake(tensor):
        _PLAIN_TYPES.add(kind)  # looked up once per type, not once per tensor
        return True
    return not hasattr(tensor, "__tensor_flatten__")


def plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    if is_plain(tensor):
        yield tensor
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):
            yield from plain_tensors(inner)


def op_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The plain tensors of an op's arguments: flat tensors and lists of them without pytree's overhead."""
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            if is_plain(value):
                found.append(value)
            else:
                found.extend(plain_tensors(value))
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    found.extend(plain_tensors(item))
                elif item is not None and not isinstance(item, (int, float, bool, str)):
                    found.extend(iter_tensors(item))
        elif value is not None and not isinstance(value, (int, float, bool, str, torch.dtype, torch.device)):
            found.extend(iter_tensors(value))
    return found


def is_parameter(tensor: torch.Tensor) -> bool:
    """``isinstance(tensor, nn.Parameter)`` without Parameter's Python ``__instancecheck__``."""
    return type(tensor) is nn.Parameter or getattr(tensor, "_is_param", False)


def optimizer_state_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every plain tensor held in an optimizer's ``state`` (ZeRO / Lightning wrappers unwrapped)."""
    seen: set[int] = set()
    stack = [optimizer]
    while stack:
        opt = stack.pop()
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        state = getattr(opt, "state", None)
        if isinstance(state, dict):
            for value in state.values():
                yield from iter_tensors(value)
        for inner in ("optim", "_optimizer", "optimizer"):
            stack.append(getattr(opt, inner, None))
