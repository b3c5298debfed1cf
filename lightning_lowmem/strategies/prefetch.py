"""Data loading for the low-memory strategies: copy the next batch to the GPU while this one trains,
and warn when the DataLoader's own queue holds a lot of memory.

``CUDAPrefetchLoader`` wraps a DataLoader: before handing out batch ``i`` it has already started
copying batch ``i + 1`` from pinned host memory with ``non_blocking=True`` on a side CUDA stream, so
the copy overlaps batch ``i``'s compute. The main stream waits for a batch's copy only when it gets
the batch, and ``record_stream`` tells the caching allocator the batch is used on the main stream.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from lightning_lowmem._compat import tree_leaves, tree_map

__all__ = ["DATALOADER_WARN_BYTES", "CUDAPrefetchLoader", "batch_bytes", "prefetched_bytes"]

DATALOADER_WARN_BYTES = 2**30
"""Warn when the DataLoader's worker queue is estimated to hold more than this (or 10% of the budget)."""

_END = object()


def batch_bytes(batch: Any) -> int:
    """Bytes of the tensors in ``batch`` (a tensor or any nest of lists / tuples / dicts of them)."""
    return sum(leaf.numel() * leaf.element_size() for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor))


def prefetched_bytes(dataloader: Any, one_batch_bytes: int) -> int:
    """Host memory the DataLoader's workers keep filled: ``prefetch_factor × num_workers`` batches.

    Example::

        >>> data = torch.utils.data.TensorDataset(torch.zeros(64, 1024))
        >>> loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=2, prefetch_factor=4)
        >>> prefetched_bytes(loader, batch_bytes(next(iter(data))) * 8)
        262144
    """
    workers = getattr(dataloader, "num_workers", 0) or 0
    if workers == 0:
        return 0  # batches are loaded in the main process, one at a time
    factor = getattr(dataloader, "prefetch_factor", None) or 2  # torch's default with workers
    return int(factor) * int(workers) * one_batch_bytes


class CUDAPrefetchLoader:
    """Iterate ``dataloader`` with each batch already on ``device``, copied one step ahead.

    Attributes other than iteration (``dataset``, ``sampler``, ``batch_size``, ...) and ``len()`` are
    the wrapped DataLoader's, so Lightning's sampler handling (``set_epoch``) keeps working.

    Args:
        dataloader: the DataLoader (any iterable of batches). Set ``pin_memory=True`` on it; batches
            that are not pinned are pinned here first (one extra host copy).
        device: the CUDA device to copy to.
    """

    def __init__(self, dataloader: Any, device: torch.device) -> None:
        if torch.device(device).type != "cuda":
            raise ValueError(f"`device`={device!r}: CUDAPrefetchLoader copies to a CUDA device only")
        self.dataloader = dataloader
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:
        if name == "dataloader":  # not set yet (e.g. while unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def _copy_ahead(self, batches: Iterator[Any], stream: torch.cuda.Stream) -> Any:
        try:
            batch = next(batches)
        except StopIteration:
            return _END

        def copy(tensor: Any) -> Any:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                return tensor
            pinned = tensor if tensor.is_pinned() else tensor.pin_memory()
            return pinned.to(self.device, non_blocking=True)

        with torch.cuda.stream(stream):
            return tree_map(copy, batch)

    def __iter__(self) -> Iterator[Any]:
        stream = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        batches = iter(self.dataloader)
        ahead = self._copy_ahead(batches, stream)
        while ahead is not _END:
            current = ahead
            main.wait_stream(stream)  # batch i's copy is done before anything on the main stream reads it
            for leaf in tree_leaves(current):
                if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
                    leaf.record_stream(main)  # allocated on the side stream, used on the main one
            ahead = self._copy_ahead(batches, stream)  # batch i + 1 starts copying now ...
            yield current  # ... while batch i trains
