"""What the CUDA caching allocator reserves for a step: its rounding and segments, simulated on fake tensors.

``torch.cuda.max_memory_allocated`` counts the blocks handed to tensors; ``torch.cuda.max_memory_reserved``
the segments the allocator took from the driver (``cudaMalloc``) to cut them from, which ``nvidia-smi``
shows (plus the CUDA context). The rules, from torch's ``c10/cuda/CUDACachingAllocator.cpp`` (defaults: no
``PYTORCH_CUDA_ALLOC_CONF``, no expandable segments), and the CUDA semantics notes
(https://pytorch.org/docs/stable/notes/cuda.html#memory-management):

* every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``, ``round_size``);
* requests of at most 1 MiB (``kSmallSize``) come from the small pool, cut from 2 MiB segments
  (``kSmallBuffer``); larger ones from the large pool: a request under 10 MiB (``kMinLargeAlloc``) opens a
  20 MiB segment (``kLargeBuffer``), a larger one a segment of its size rounded up to 2 MiB (``kRoundLarge``);
* a request takes the smallest free block of its pool that is large enough (best fit, ``get_free_block``);
  only when none is free is a new segment allocated. A block is split when what remains is at least
  512 bytes (small pool) or more than 1 MiB (large pool), else handed out whole (``should_split``);
* a freed block merges with its free neighbours of the same segment; segments are kept (cached) until
  ``torch.cuda.empty_cache()``, which a training step never calls.

:class:`AllocatorSimulation` runs these rules over the allocations and frees of a fake step (one stream;
the allocator's retry after freeing cached segments on an out-of-memory error is not modelled: the card is
assumed large enough).
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from lightning_lowmem._compat import TorchDispatchMode, tree_leaves

MIN_BLOCK_BYTES = 512
SMALL_SIZE_BYTES = 2**20
SMALL_BUFFER_BYTES = 2 * 2**20
MIN_LARGE_ALLOC_BYTES = 10 * 2**20
LARGE_BUFFER_BYTES = 20 * 2**20
ROUND_LARGE_BYTES = 2 * 2**20


def round_size(nbytes: int) -> int:
    """The block size a request of ``nbytes`` books (``round_size``: 512-byte multiples, at least 512)."""
    return max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator books for a storage of ``nbytes``: :func:`round_size`, none for an empty one."""
    return round_size(nbytes) if nbytes > 0 else 0


def segment_size(size: int) -> int:
    """The segment ``cudaMalloc``'d for a rounded request ``size`` no free block can hold (``get_allocation_size``)."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: "_Block | None" = field(default=None, repr=False)
    next: "_Block | None" = field(default=None, repr=False)

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


class CachingAllocator:
    """The caching allocator's bookkeeping on one stream (module docstring): blocks, segments and their peaks.

    Example::

        >>> allocator = CachingAllocator()
        >>> block = allocator.malloc(1000)  # a 1024-byte block of a new 2 MiB small segment
        >>> allocator.allocated_bytes, allocator.reserved_bytes
        (1024, 2097152)
        >>> allocator.free(block); allocator.malloc(3 * 2**20) is not None, allocator.reserved_bytes // 2**20
        (True, 22)
    """

    def __init__(self) -> None:
        self._free: dict[bool, list[tuple[tuple[int, int, int], _Block]]] = {True: [], False: []}
        self._segments = 0
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0

    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE_BYTES
        pool = self._free[small]
        index = bisect.bisect_left(pool, (size, -1, -1), key=lambda item: item[0])
        if index < len(pool):
            block = pool.pop(index)[1]
        else:  # no cached block fits: a new segment from the driver
            block = _Block(self._segments, 0, segment_size(size), small)
            self._segments += 1
            self.reserved_bytes += block.size
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        remaining = block.size - size
        if remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_SIZE_BYTES:
            rest = _Block(block.segment, block.offset + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.free = False
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return block

    def free(self, block: _Block) -> None:
        self.allocated_bytes -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._insert(block)

    def state(self) -> tuple:
        """The bookkeeping that decides every later block and peak: the bytes allocated and reserved, and each
        pool's free blocks (the allocated ones are the rest of the segments)."""
        free = tuple(tuple(key for key, _ in self._free[small]) for small in (True, False))
        return self.allocated_bytes, self.reserved_bytes, self._segments, free

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.key(), block), key=lambda item: item[0])

    def _remove(self, block: _Block) -> None:
        pool = self._free[block.small]
        index = bisect.bisect_left(pool, block.key(), key=lambda item: item[0])
        pool.pop(index)


class AllocatorSimulation(TorchDispatchMode):
    """Inside a fake step: every new storage is a :meth:`CachingAllocator.malloc`, its release a ``free``.

    Args:
        existing: tensors alive before the step (parameters, gradients, optimizer state, the batch), booked first
            in this order, as training allocated them before this step.

    ``self.allocator`` holds the peaks (:attr:`CachingAllocator.peak_reserved_bytes`).
    """

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.allocator = CachingAllocator()
        self._blocks: dict[int, Any] = {}
        for tensor in existing:
            self._book(tensor)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._book(tensor)
        return out

    def _book(self, tensor: torch.Tensor) -> None:
        from lightning_lowmem.memory._tensors import plain_tensors

        for plain in plain_tensors(tensor):
            try:
                storage = plain.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse / nested / exotic layouts
                continue
            key = id(storage)
            if key in self._blocks or storage.nbytes() == 0:
                continue
            block = self.allocator.malloc(storage.nbytes())
            self._blocks[key] = (block, weakref.ref(storage, self._freed(key)))

    def _freed(self, key: int) -> Any:
        def freed(_: Any) -> None:
            entry = self._blocks.pop(key, None)
            if entry is not None:
                self.allocator.free(entry[0])

        return freed
