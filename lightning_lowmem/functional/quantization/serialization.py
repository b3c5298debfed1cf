"""Quantized weights in checkpoints: pickled as plain tensors plus a description, rebuilt on load.

torch pickles torchao's tensor subclasses through ``torch._utils._rebuild_wrapper_subclass``, which

* cannot run under a callable ``map_location`` (Lightning's default: ``Callable map_location not supported
  with _rebuild_wrapper_subclass``), and
* needs torchao's classes allowlisted for ``torch.load(weights_only=True)``, i.e. torchao imported first.

:func:`make_portable` marks one torchao tensor so that pickling it stores its inner *plain* tensors
(``qdata``, ``scale``, ...) and its attributes encoded as primitives, behind one function,
:func:`rebuild_quantized_tensor`, which rebuilds the torchao tensor at load time. Plain tensors go through
any ``map_location``; :func:`register_safe_globals` allowlists that one function for ``weights_only=True``
(``import lightning_lowmem`` does it as soon as torch is loaded; torchao is imported only when a quantized
tensor is actually rebuilt). The in-memory tensor is unchanged, and the object that is loaded is the same
torchao tensor class with the same inner tensors.

Only classes, dataclasses and enums from ``torchao`` modules are rebuilt by name. Nothing here imports
Lightning or torchao at import time.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import sys
from typing import Any

import torch

__all__ = [
    "is_quantized_tensor",
    "keep_portable_",
    "make_portable",
    "rebuild_quantized_tensor",
    "register_safe_globals",
]

_ALLOWED_ROOT = "torchao."


def is_quantized_tensor(value: Any) -> bool:
    """A torchao tensor subclass (anything but a plain tensor / Parameter that flattens into inner tensors)."""
    return (
        isinstance(value, torch.Tensor)
        and type(value) not in (torch.Tensor, torch.nn.Parameter)
        and hasattr(type(value), "__tensor_flatten__")
        and type(value).__module__.startswith(_ALLOWED_ROOT)
    )


class _NotPortable(TypeError):
    pass


def _qualname(obj: type) -> str:
    return sys.intern(f"{obj.__module__}:{obj.__qualname__}")  # one object: pickled once per file, then memo references


def _encode(value: Any) -> Any:
    """Primitives (and torch dtypes) as they are; containers, enums and dataclasses as tagged tuples."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, enum.Enum):
        return ("enum", _qualname(type(value)), value.name)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [(f.name, _encode(getattr(value, f.name))) for f in dataclasses.fields(value) if f.init]
        return ("dataclass", _qualname(type(value)), fields)
    if isinstance(value, torch.Size):
        return ("size", [int(v) for v in value])
    if isinstance(value, tuple):
        return ("tuple", [_encode(v) for v in value])
    if isinstance(value, list):
        return ("list", [_encode(v) for v in value])
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return ("dict", [(k, _encode(v)) for k, v in value.items()])
    raise _NotPortable(f"cannot encode a {type(value).__name__}")


def _torchao_object(qualname: str, kind: str) -> Any:
    module_name, _, name = qualname.partition(":")
    if not module_name.startswith(_ALLOWED_ROOT):
        raise ValueError(f"refusing to rebuild {qualname!r}: only torchao {kind}s are rebuilt from a checkpoint.")
    obj: Any = importlib.import_module(module_name)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _decode(value: Any) -> Any:
    if not isinstance(value, tuple):
        return value
    tag, *rest = value
    if tag == "enum":
        cls = _torchao_object(rest[0], "enum")
        if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
            raise ValueError(f"{rest[0]!r} is not an enum.")
        return cls[rest[1]]
    if tag == "dataclass":
        cls = _torchao_object(rest[0], "dataclass")
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ValueError(f"{rest[0]!r} is not a dataclass.")
        return cls(**{name: _decode(v) for name, v in rest[1]})
    if tag == "size":
        return torch.Size(rest[0])
    if tag == "tuple":
        return tuple(_decode(v) for v in rest[0])
    if tag == "list":
        return [_decode(v) for v in rest[0]]
    if tag == "dict":
        return {name: _decode(v) for name, v in rest[0]}
    raise ValueError(f"unknown encoded value {value!r}")


def rebuild_quantized_tensor(
    class_name: str, inner: dict[str, torch.Tensor], attributes: Any, size: list[int], stride: list[int]
) -> torch.Tensor:
    """Rebuild a torchao tensor pickled by :func:`make_portable` (called by ``torch.load``)."""
    cls = _torchao_object(class_name, "tensor class")
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
        raise ValueError(f"{class_name!r} is not a tensor class.")
    return cls.__tensor_unflatten__(inner, _decode(attributes), torch.Size(size), tuple(stride))


def _portable_reduce(tensor: torch.Tensor, protocol: int) -> tuple[Any, tuple[Any, ...]]:
    names, attributes = tensor.__tensor_flatten__()
    inner = {name: getattr(tensor, name) for name in names}
    arguments = (_qualname(type(tensor)), inner, _encode(attributes), list(tensor.shape), list(tensor.stride()))
    return rebuild_quantized_tensor, arguments


def make_portable(tensor: torch.Tensor) -> bool:
    """Make pickling ``tensor`` (a torchao tensor) store plain inner tensors + an encoded description.

    Only this object is affected (its ``__reduce_ex__``); mark the tensors of a state dict about to be
    saved, not the model's parameters. Returns ``False`` (and changes nothing) when ``tensor`` is not a
    torchao tensor or holds an attribute that cannot be encoded (it then pickles the torchao way).

    Example::

        >>> import io, torch
        >>> from torch import nn
        >>> from lightning_lowmem.functional.quantization.ptq import quantize_
        >>> layer = nn.Sequential(nn.Linear(32, 32))
        >>> _ = quantize_(layer, "int8_dynamic")
        >>> state = layer.state_dict()
        >>> make_portable(state["0.weight"])
        True
        >>> buffer = io.BytesIO(); torch.save(state, buffer); _ = buffer.seek(0)
        >>> loaded = torch.load(buffer, map_location=lambda storage, loc: storage, weights_only=True)
        >>> type(loaded["0.weight"]).__name__, torch.equal(loaded["0.weight"].dequantize(), layer[0].weight.dequantize())
        ('Int8Tensor', True)
    """
    if not is_quantized_tensor(tensor):
        return False
    try:
        names, attributes = tensor.__tensor_flatten__()
        if not all(type(getattr(tensor, name)) in (torch.Tensor, torch.nn.Parameter) for name in names):
            return False  # nested subclasses: leave them to torch / torchao
        _encode(attributes)
    except (_NotPortable, AttributeError, TypeError):
        return False
    tensor.__reduce_ex__ = functools.partial(_portable_reduce, tensor)  # type: ignore[method-assign]
    return True


def keep_portable_(module: torch.nn.Module) -> None:
    """Make every ``state_dict()`` holding ``module`` carry its torchao tensors portably (:func:`make_portable`),
    also where no callback's ``on_save_checkpoint`` runs (``trainer.save_checkpoint(path, weights_only=True)``,
    ``ModelCheckpoint(save_weights_only=True)``, ``torch.save(model.state_dict())``), so Lightning's callable
    ``map_location`` loads them. A state-dict post hook on ``module`` (idempotent; it travels with the module);
    ``keep_vars=True`` state dicts (the parameters themselves) are left alone.

    Example::

        >>> import io
        >>> from lightning_lowmem.functional.quantization.ptq import quantize_
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32))
        >>> _ = quantize_(model, "int8_weight_only")  # calls keep_portable_(model)
        >>> buffer = io.BytesIO(); torch.save(model.state_dict(), buffer); _ = buffer.seek(0)
        >>> type(torch.load(buffer, map_location=lambda storage, loc: storage, weights_only=True)["0.weight"]).__name__
        'Int8Tensor'
    """
    if not module.__dict__.get("_lowmem_portable_state_dict"):
        module.register_state_dict_post_hook(_make_state_dict_portable)
        module.__dict__["_lowmem_portable_state_dict"] = True


def _make_state_dict_portable(
    module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    for key, value in state_dict.items():
        if key.startswith(prefix) and is_quantized_tensor(value) and not isinstance(value, torch.nn.Parameter):
            make_portable(value)


def register_safe_globals() -> None:
    """Allowlist :func:`rebuild_quantized_tensor` for ``torch.load(weights_only=True)`` (idempotent)."""
    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is not None and rebuild_quantized_tensor not in torch.serialization.get_safe_globals():
        add_safe_globals([rebuild_quantized_tensor])


register_safe_globals()
