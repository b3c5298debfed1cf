"""Compress the tensors autograd saves for backward: ``compress_activations`` and ``exact_activations``.

Inside ``compress_activations(mode)`` every tensor an op saves for backward passes through a pack hook
(``torch.autograd.graph.saved_tensors_hooks``) that stores a smaller copy, and the original is freed
once forward drops it. Backward unpacks the copy. Parameters (and views of them; also any other leaf
tensor that requires grad), non-float tensors, tensors under ``min_bytes`` and anything inside
``exact_activations()`` are kept as they are.

Modes:

* ``"bf16"``: 32/64-bit floats are kept as bfloat16 (2 bytes per element; 16-bit inputs are kept).
* ``"int8"``: int8 with one float32 scale per row of the last dimension (symmetric, round to nearest).
* ``"cpu"``: offload to host memory. On CUDA: a pinned buffer filled on a side stream, copied back
  when backward needs it. On a CPU device the tensor already lives in host memory, so this mode is a
  no-op (the tensor is kept, not copied).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from lightning_lowmem._compat.autograd import view_base
from lightning_lowmem._compat.fake_mode import is_fake
from lightning_lowmem.functional.config.constants import COMPRESSION_MIN_BYTES, COMPRESSION_MODES
from lightning_lowmem.memory.measure import tagged_allocations

if TYPE_CHECKING:
    from lightning_lowmem.functional.config.techniques import CompressionConfig

__all__ = ["COMPRESSION_MODES", "CompressionStats", "compress_activations", "exact_activations"]


DEFAULT_MIN_BYTES = COMPRESSION_MIN_BYTES  # the old name

_local = threading.local()


def _exact_depth() -> int:
    return getattr(_local, "exact_depth", 0)


@contextlib.contextmanager
def exact_activations() -> Iterator[None]:
    """Opt-out region: tensors saved for backward inside it are kept exact, even inside
    :func:`compress_activations`. Nests; costs nothing outside a compression region.

    Example::

        >>> layer = torch.nn.Linear(512, 512)
        >>> with compress_activations("int8", min_bytes=0) as stats:
        ...     with exact_activations():
        ...         out = torch.tanh(layer(torch.randn(64, 512)))
        >>> stats.packed
        0
    """
    _local.exact_depth = _exact_depth() + 1
    try:
        yield
    finally:
        _local.exact_depth -= 1


@dataclass
class CompressionStats:
    """Counts of one compression region (cumulative when a stats object is reused).

    Attributes:
        packed: tensors stored compressed (or offloaded).
        kept: tensors saved as they were (parameters, small, non-float, exact region, no-op mode).
        bytes_in: bytes of the packed tensors before packing.
        bytes_out: bytes kept on the tensors' device for them (0 for offloaded tensors).
    """

    packed: int = 0
    kept: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    @property
    def ratio(self) -> float:
        """``bytes_in / bytes_out`` (``inf`` when everything packed was offloaded, 1.0 when nothing was)."""
        if self.bytes_in == 0:
            return 1.0
        return self.bytes_in / self.bytes_out if self.bytes_out else float("inf")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _is_parameter_like(tensor: torch.Tensor) -> bool:
    if isinstance(tensor, nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
        return True
    base = view_base(tensor)
    return base is not None and (isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad))


_CHUNK_ELEMENTS = 1 << 16  # rows are (de)quantized this many elements at a time: a 256 KiB fp32 temporary


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as (R, N) rows of its last dimension (if it has >= 16 elements), else one row."""
    if tensor.dim() > 0 and tensor.shape[-1] >= 16:
        return tensor.reshape(-1, tensor.shape[-1])
    return tensor.reshape(1, -1)


def _row_chunks(rows: int, width: int) -> range:
    return range(0, rows, max(1, _CHUNK_ELEMENTS // max(width, 1)))


def _chunk_starts(chunks: range, tensor: torch.Tensor) -> Any:
    """The chunks to run. On fake tensors (``estimate_memory``) every chunk allocates and frees
    temporaries no larger than the first chunk's (the last may be smaller) and writes into storage that
    already exists: the first chunk shows the loop's peak, so only it runs (a 7B model's estimate runs
    thousands of chunks otherwise, and the planner runs this for every int8 candidate)."""
    if len(chunks) > 1 and is_fake(tensor):
        return (chunks[0],)
    return chunks


def _quantize_int8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: ``tensor ≈ q * scale``; rows are the last dimension (if it has >= 16).

    Works on a few rows at a time (one fp32 copy of them, scaled and rounded in place), so the only
    full-size allocation is the int8 result, and each chunk is read from memory once.
    """
    rows = _as_rows(tensor)  # (R, N), a view when possible
    quantized = torch.empty(rows.shape, dtype=torch.int8, device=rows.device)  # (R, N)
    scale = torch.empty((rows.shape[0], 1), dtype=torch.float32, device=rows.device)  # (R, 1)
    chunks = _row_chunks(*rows.shape)
    for start in _chunk_starts(chunks, tensor):
        block = rows[start : start + chunks.step].to(torch.float32, copy=True)  # (chunk, N)
        block_scale = block.abs().amax(dim=1, keepdim=True)  # (chunk, 1)
        if is_fake(tensor):  # estimate_memory: the rest is in place / into slices, allocating nothing
            del block, block_scale
            break
        block_scale.clamp_min_(1e-12).div_(127.0)
        scale[start : start + chunks.step] = block_scale
        quantized[start : start + chunks.step] = block.div_(block_scale).round_()  # |values| <= 127
        del block, block_scale  # freed before the next chunk's copy exists: every chunk peaks alike
    return quantized, scale


def _dequantize_int8(
    quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, shape: torch.Size
) -> torch.Tensor:
    """Inverse of :func:`_quantize_int8`, written straight into a tensor of ``dtype`` chunk by chunk."""
    out = torch.empty(quantized.shape, dtype=dtype, device=quantized.device)  # (R, N)
    chunks = _row_chunks(*quantized.shape)
    for start in _chunk_starts(chunks, quantized):
        out[start : start + chunks.step] = quantized[start : start + chunks.step] * scale[start : start + chunks.step]
    return out.reshape(shape)


class _Packer:
    """The pack / unpack pair of one :func:`compress_activations` region."""

    def __init__(self, mode: str, min_bytes: int, stats: CompressionStats) -> None:
        self.mode = mode
        self.min_bytes = min_bytes
        self.stats = stats
        self._side_streams: dict[torch.device, Any] = {}

    def _keep(self, tensor: torch.Tensor) -> bool:
        nbytes = _nbytes(tensor)
        if _exact_depth() > 0 or not tensor.is_floating_point() or nbytes == 0 or nbytes < self.min_bytes:
            return True
        if _is_parameter_like(tensor):
            return True
        if self.mode == "bf16" and tensor.element_size() <= 2:
            return True
        return self.mode == "cpu" and tensor.device.type == "cpu"  # already in host memory: no-op

    def pack(self, tensor: torch.Tensor) -> Any:
        with tagged_allocations("activation packing"):  # what packing makes, for the memory tracker's "other"
            return self._pack(tensor)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._keep(tensor):
            self.stats.kept += 1
            return tensor
        self.stats.packed += 1
        self.stats.bytes_in += _nbytes(tensor)
        if self.mode == "bf16":
            packed = tensor.to(torch.bfloat16)
            self.stats.bytes_out += _nbytes(packed)
            return ("bf16", packed, tensor.dtype)
        if self.mode == "int8":
            quantized, scale = _quantize_int8(tensor)
            self.stats.bytes_out += _nbytes(quantized) + _nbytes(scale)
            return ("int8", quantized, scale, tensor.dtype, tensor.shape)
        return self._offload(tensor)

    def _offload(self, tensor: torch.Tensor) -> Any:
        if is_fake(tensor) or tensor.device.type != "cuda":  # estimator: a plain move is exact enough
            return ("host", tensor.to("cpu"), tensor.device)
        stream = self._side_streams.get(tensor.device)
        if stream is None:
            stream = self._side_streams[tensor.device] = torch.cuda.Stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # tensor is fully written
        with torch.cuda.stream(stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        tensor.record_stream(stream)  # the allocator must not reuse its memory before the copy ends
        return ("pinned", host, copied, tensor.device)

    def unpack(self, packed: Any) -> torch.Tensor:
        with tagged_allocations("activation packing"):
            return self._unpack(packed)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        kind = packed[0]
        if kind == "bf16":
            _, data, dtype = packed
            return data.to(dtype)
        if kind == "int8":
            _, quantized, scale, dtype, shape = packed
            return _dequantize_int8(quantized, scale, dtype, shape)
        if kind == "host":
            _, host, device = packed
            return host.to(device)
        _, host, copied, device = packed  # "pinned"
        torch.cuda.current_stream(device).wait_event(copied)
        return host.to(device, non_blocking=True)


@contextlib.contextmanager
def compress_activations(
    mode: str | CompressionConfig = "int8", min_bytes: int | None = None, stats: CompressionStats | None = None
) -> Iterator[CompressionStats]:
    """Store the tensors saved for backward inside this block compressed (or offloaded).

    Only the forward pass needs to run inside the block: what was packed is unpacked by backward
    wherever it runs. Tensors saved by regions wrapped with activation checkpointing are not saved at
    all (only the checkpointed region's inputs are, and those are compressed).

    Args:
        mode: a :class:`~lightning_lowmem.functional.config.CompressionConfig`, or its shorthand: ``"bf16"``,
            ``"int8"`` or ``"cpu"`` (see the module docstring), which builds one with ``min_bytes``.
            Default: ``"int8"``.
        min_bytes: with a mode name, tensors smaller than this are kept as they are. Default: ``None``:
            :data:`~lightning_lowmem.functional.config.constants.COMPRESSION_MIN_BYTES` (64 KiB).
        stats: a :class:`CompressionStats` to add counts to (e.g. one per training run). Default: a new one.

    Yields:
        The :class:`CompressionStats` being filled.

    Raises:
        ValueError: ``mode`` is unknown or ``min_bytes`` is negative (the config's checks).
        TypeError: ``min_bytes`` is not an int.

    Example::

        >>> mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
        >>> with compress_activations("bf16", min_bytes=0) as stats:
        ...     loss = mlp(torch.randn(128, 256)).square().mean()
        >>> loss.backward()
        >>> stats.packed, stats.ratio
        (4, 2.0)
    """
    from lightning_lowmem.functional.config.techniques import CompressionConfig

    if not isinstance(mode, CompressionConfig):
        mode = CompressionConfig(mode) if min_bytes is None else CompressionConfig(mode, min_bytes)
    elif min_bytes is not None:
        raise ValueError(f"`min_bytes`={min_bytes!r} is given beside a CompressionConfig; set it in the config")
    config = mode
    stats = stats if stats is not None else CompressionStats()
    packer = _Packer(config.mode, config.min_bytes, stats)
    with torch.autograd.graph.saved_tensors_hooks(packer.pack, packer.unpack):
        yield stats
