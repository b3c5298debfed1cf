"""Bitmask + values packing of mostly-zero tensors: lightning_lowmem's one sparse format.

``CompressedCheckpointIO`` (:mod:`lightning_lowmem.checkpoints`) packs checkpoints with it and
:func:`to_sparse_state_dict` exports state dicts with it; :func:`from_sparse_state_dict` also reads the
marker-less layout that ``to_sparse_state_dict`` wrote before there was one format.

A tensor with ``N`` elements of which a share ``s`` is zero is stored as a ``uint8`` bitmask of ``N / 8``
bytes (bit set = non-zero) plus its ``(1 - s) * N`` non-zero values, in their dtype. For a 90%-sparse
fp32 weight that is ``N/8 + 0.4 N`` bytes instead of ``4 N``: 7.6x smaller before any compression.

The packed form is a plain ``dict`` of tensors, ints and strings, so it pickles with ``torch.save`` and
loads back with ``torch.load(weights_only=True)``. Unpacking is exact: every value comes back
bit-for-bit (``-0.0`` comes back as ``0.0``, which ``torch.equal`` treats as equal).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = [
    "SPARSE_MARKER",
    "from_sparse_state_dict",
    "is_packed_sparse",
    "pack_sparse",
    "pack_sparse_tree",
    "packed_nbytes",
    "should_pack",
    "tensor_key",
    "to_sparse_state_dict",
    "unpack_sparse",
    "unpack_sparse_tree",
]

SPARSE_MARKER = "__lowmem_sparse_v1__"
"""Key that marks a dict as a packed sparse tensor."""

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """(N,) bool -> (ceil(N / 8),) uint8, most significant bit first."""
    padded = torch.zeros(-(-mask.numel() // 8) * 8, dtype=torch.uint8)
    padded[: mask.numel()] = mask.to(torch.uint8)
    return (padded.view(-1, 8) * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)  # (N/8,)


def _unpack_bits(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """(ceil(N / 8),) uint8 -> (N,) bool."""
    expanded = bits.unsqueeze(1).bitwise_and(_BIT_WEIGHTS.to(bits.device)) != 0  # (N/8, 8)
    return expanded.reshape(-1)[:numel]


def tensor_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Identity of a tensor's data: the same for every view object of one storage region (a ``state_dict()`` of a
    model with tied weights holds one detached tensor object per key, all of them views of the same storage)."""
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # fake / meta / subclass tensors without a real storage
        return ("id", id(tensor))
    if pointer == 0:
        return ("id", id(tensor))
    return (pointer, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)


# should_pack samples every 61st value of a large tensor first (a prime stride meets every column of a matrix,
# so pruned rows or columns show); under half of min_sparsity there means dense without a full count
_SAMPLE_FROM, _SAMPLE_STRIDE = 2**16, 61


def should_pack(tensor: Any, min_sparsity: float = 0.3, min_numel: int = 1024) -> bool:
    """True when ``tensor`` is a dense floating-point tensor worth storing as bitmask + values.

    Args:
        tensor: anything; only plain (non-subclass) strided float tensors qualify.
        min_sparsity: the share of exact zeros needed. Default: 0.3.
        min_numel: smaller tensors are left dense. Default: 1024.
    """
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        return False
    if tensor.layout != torch.strided or not tensor.is_floating_point() or tensor.numel() < min_numel:
        return False
    if tensor.device.type == "meta":
        return False
    if tensor.numel() >= _SAMPLE_FROM and tensor.is_contiguous():  # a strided sample first: dense costs no full count
        sample = tensor.view(-1)[::_SAMPLE_STRIDE]
        if sample.numel() - int(torch.count_nonzero(sample)) < 0.5 * min_sparsity * sample.numel():
            return False
    zeros = tensor.numel() - int(torch.count_nonzero(tensor))  # no bool temporary, unlike (tensor == 0).sum()
    return zeros >= min_sparsity * tensor.numel()


def pack_sparse(tensor: torch.Tensor) -> dict[str, Any]:
    """Pack ``tensor`` as ``{"bitmask", "values", "shape", "device"}`` (values on CPU).

    Args:
        tensor: any strided tensor (float or not).

    Returns:
        A dict with the :data:`SPARSE_MARKER` key; see :func:`unpack_sparse`.

    Example::

        >>> weight = torch.tensor([[0.0, 1.5], [0.0, 0.0]])
        >>> packed = pack_sparse(weight)
        >>> packed["values"], packed["bitmask"]
        (tensor([1.5000]), tensor([64], dtype=torch.uint8))
        >>> torch.equal(unpack_sparse(packed), weight)
        True
    """
    flat = tensor.detach().reshape(-1).cpu()  # (N,)
    mask = flat != 0  # NaN != 0, so NaNs are kept as values
    return {
        SPARSE_MARKER: True,
        "shape": list(tensor.shape),
        "device": str(tensor.device),
        "bitmask": _pack_bits(mask),
        "values": flat[mask].clone(),
    }


def is_packed_sparse(obj: Any) -> bool:
    """True when ``obj`` is a dict produced by :func:`pack_sparse`."""
    return isinstance(obj, dict) and obj.get(SPARSE_MARKER) is True


def unpack_sparse(packed: dict[str, Any], device: str | torch.device | None = None) -> torch.Tensor:
    """Rebuild the dense tensor from :func:`pack_sparse`'s dict.

    Args:
        packed: the dict.
        device: where to build it. Default: CPU (a checkpoint's ``map_location`` moves it later).

    Raises:
        ValueError: ``packed`` is not a packed tensor, or its parts disagree (corrupt data).
    """
    if not is_packed_sparse(packed):
        raise ValueError(f"`packed` is not a packed sparse tensor (no {SPARSE_MARKER!r} key): {type(packed).__name__}")
    shape = torch.Size(packed["shape"])
    values: torch.Tensor = packed["values"]
    numel = shape.numel()
    mask = _unpack_bits(packed["bitmask"], numel)
    if mask.numel() != numel or int(mask.sum()) != values.numel():
        raise ValueError(
            f"packed sparse tensor of shape {list(shape)} is corrupt: bitmask marks {int(mask.sum())} non-zeros "
            f"({mask.numel()} bits) but {values.numel()} values are stored"
        )
    dense = torch.zeros(numel, dtype=values.dtype, device=device or "cpu")
    dense[mask.to(dense.device)] = values.to(dense.device)
    return dense.view(shape)


def packed_nbytes(packed: dict[str, Any]) -> int:
    """Bytes of tensor data in a packed tensor (bitmask + values)."""
    return packed["bitmask"].nbytes + packed["values"].nbytes


def pack_sparse_tree(obj: Any, min_sparsity: float = 0.3, min_numel: int = 1024) -> tuple[Any, int]:
    """Replace every tensor in a nested dict / list / tuple that :func:`should_pack` accepts.

    The same tensor data met twice (tied weights, also as two detached views in a ``state_dict()``) is packed
    once and shared, so ``torch.save`` stores it once. Everything else is returned as it is (not copied).

    Returns:
        ``(new_obj, num_packed)``.
    """
    memo: dict[tuple[Any, ...], Any] = {}
    count = 0

    def visit(value: Any) -> Any:
        nonlocal count
        if isinstance(value, torch.Tensor):
            key = tensor_key(value)
            if key in memo:
                return memo[key]
            result = value
            if should_pack(value, min_sparsity, min_numel):
                result = pack_sparse(value)
                count += 1
            memo[key] = result
            return result
        if (
            isinstance(value, dict)
            and not is_packed_sparse(value)
            or isinstance(value, list)
            or (isinstance(value, tuple) and not hasattr(value, "_fields"))
        ):
            return _rebuild(value, visit)
        return value

    return visit(obj), count


def _rebuild(container: Any, visit: Any) -> Any:
    """``container`` (a dict of any subclass, a list, a tuple) with its values visited: the very same object when no
    value changed (a dense checkpoint is saved as it is), else a copy keeping the dict's type and attributes (the
    ``_metadata`` of a ``state_dict()``)."""
    values = list(container.values() if isinstance(container, dict) else container)
    visited = [visit(value) for value in values]
    if all(new is old for new, old in zip(visited, values, strict=True)):
        return container
    if isinstance(container, list):
        return visited
    if isinstance(container, tuple):
        return tuple(visited)
    items = zip(container.keys(), visited, strict=True)
    try:
        rebuilt = type(container)()
        rebuilt.update(items)
    except TypeError:
        return dict(zip(container.keys(), visited, strict=True))
    if getattr(container, "__dict__", None):
        rebuilt.__dict__.update(container.__dict__)
    return rebuilt


def unpack_sparse_tree(obj: Any, device: Callable[[str], torch.device] | None = None) -> Any:
    """Inverse of :func:`pack_sparse_tree`: dense tensors everywhere, shared packs unpacked once.

    Args:
        obj: a nested dict / list / tuple.
        device: ``device(saved_device) -> torch.device`` places each tensor (``saved_device`` is where it was
            when packed, e.g. ``"cuda:0"``). Default: ``None`` (CPU).
    """
    memo: dict[int, torch.Tensor] = {}

    def visit(value: Any) -> Any:
        if is_packed_sparse(value):
            if id(value) not in memo:
                memo[id(value)] = unpack_sparse(value, None if device is None else device(value.get("device", "cpu")))
            return memo[id(value)]
        if (
            isinstance(value, dict)
            or isinstance(value, list)
            or (isinstance(value, tuple) and not hasattr(value, "_fields"))
        ):
            return _rebuild(value, visit)
        return value

    return visit(obj)


def to_sparse_state_dict(state_dict: dict[str, torch.Tensor], min_sparsity: float = 0.5) -> dict[str, Any]:
    """``state_dict`` with every float tensor of at least ``min_sparsity`` zeros packed (:func:`pack_sparse`).

    The one sparse format, the same as ``CompressedCheckpointIO`` writes: the result ``torch.save``-s and loads
    with ``weights_only=True``; a tensor under several keys (tied weights) is packed once and shared.

    Args:
        state_dict: name -> tensor.
        min_sparsity: share of zeros from which a tensor is packed. Default: 0.5.

    Example::

        >>> sd = {"w": torch.tensor([[0.0, 2.0], [0.0, 0.0]])}
        >>> torch.equal(from_sparse_state_dict(to_sparse_state_dict(sd))["w"], sd["w"])
        True
    """
    return pack_sparse_tree(state_dict, min_sparsity, min_numel=8)[0]


def from_sparse_state_dict(packed: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_sparse_state_dict` (keys that shared one packed entry share one tensor again).

    Also reads the marker-less ``{"shape", "bitmask", "values"}`` entries that ``to_sparse_state_dict`` wrote
    before lightning_lowmem had one sparse format (same bitmask and values, no marker, no device).

    Raises:
        ValueError: a packed entry is corrupt (its bitmask and values disagree).
    """
    memo: dict[int, dict[str, Any]] = {}

    def upgrade(value: Any) -> Any:
        if isinstance(value, dict) and value.keys() == _LEGACY_KEYS and not is_packed_sparse(value):
            if id(value) not in memo:
                memo[id(value)] = {SPARSE_MARKER: True, "device": "cpu", **value}
            return memo[id(value)]
        return value

    return unpack_sparse_tree({key: upgrade(value) for key, value in packed.items()})


_LEGACY_KEYS = {"shape", "bitmask", "values"}
