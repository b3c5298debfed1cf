"""Measure the peak memory of real work: `track_memory` (context manager) and `measure_memory`."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lightning_lowmem.memory._tracker import StorageTracker, active_tracker, tagged_allocations
from lightning_lowmem.memory.cuda_allocator import cuda_block_bytes
from lightning_lowmem.memory.report import CATEGORIES, MemoryReport

__all__ = ["MemoryTracking", "mark_memory", "measure_memory", "state_bytes", "tagged_allocations", "track_memory"]


def _resolve_device(device: str | torch.device | None, modules: list[nn.Module]) -> str:
    if device is None:
        for module in modules:
            for tensor in module.parameters():
                return tensor.device.type
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError):
        device_type = str(device)
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"`device`={device!r} is not supported; use 'cpu' or 'cuda'.")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("`device`='cuda' was requested but torch.cuda.is_available() is False on this machine.")
    return device_type


def _rss_bytes() -> int:
    import psutil

    return int(psutil.Process(os.getpid()).memory_info().rss)


class MemoryTracking:
    """Handle returned by :func:`track_memory`; ``report`` is set when the ``with`` block exits."""

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.report: MemoryReport | None = None

    @property
    def current_bytes(self) -> int:
        """Bytes live right now (inside the block)."""
        return self.tracker.current_bytes

    @property
    def peak_bytes(self) -> int:
        """Peak so far (inside the block)."""
        return self.tracker.peak_bytes


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@contextlib.contextmanager
def track_memory(
    module: nn.Module | list[nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | list[Any] | None = None,
    *,
    device: str | torch.device | None = None,
    by_module: bool = True,
) -> Iterator[MemoryTracking]:
    """Track every tensor allocated inside the block and report the peak with its breakdown.

    Args:
        module: the model(s) being run: their parameters and buffers count as ``parameters``, their
            ``.grad`` as ``gradients``, and their submodules name the ``by_module`` entries.
            Parameters met inside the block are found without it, but the breakdown is exact only
            when all model state is known from the start. Default: ``None``.
        optimizer: optimizer(s) whose ``state`` counts as ``optimizer_state``; any optimizer that
            steps inside the block is found automatically. Default: ``None``.
        device: ``"cpu"`` or ``"cuda"``: the device type whose storages are counted. Default: the
            device of ``module``'s first parameter, else CUDA when available, else CPU.
        by_module: record per-module forward figures. Default: ``True``.

    Yields:
        A :class:`MemoryTracking`; its ``report`` (a :class:`MemoryReport`) is set on exit.

    Example::

        >>> model = torch.nn.Linear(64, 64)
        >>> with track_memory(model) as tracking:
        ...     model(torch.randn(8, 64)).sum().backward()
        >>> tracking.report.breakdown["gradients"] == tracking.report.breakdown["parameters"]
        True
    """
    modules = _as_list(module)
    for item in modules:
        if not isinstance(item, nn.Module):
            raise TypeError(f"`module` must be an nn.Module (or a list of them), got {type(item).__name__}")
    device_type = _resolve_device(device, modules)
    is_cuda = device_type == "cuda"
    tracker = StorageTracker(
        device=device_type,
        modules=modules,
        optimizers=_as_list(optimizer),
        round_bytes=cuda_block_bytes if is_cuda else None,
        by_module=by_module,
    )
    handle = MemoryTracking(tracker)
    stats: dict[str, int] = {}
    if is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated_before = torch.cuda.memory_allocated()
    else:
        stats["rss_before"] = _rss_bytes()
    with tracker:
        yield handle
    report = tracker.report
    assert report is not None
    if is_cuda:
        torch.cuda.synchronize()
        stats["allocated_before"] = allocated_before
        stats["max_allocated"] = torch.cuda.max_memory_allocated()
        stats["max_reserved"] = torch.cuda.max_memory_reserved()
        stats["fragmentation"] = max(0, stats["max_reserved"] - stats["max_allocated"])
    else:
        stats["rss_after"] = _rss_bytes()
    report.device_stats = stats
    handle.report = report


def measure_memory(
    fn: Callable[..., Any],
    *args: Any,
    module: nn.Module | list[nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | list[Any] | None = None,
    device: str | torch.device | None = None,
    **kwargs: Any,
) -> MemoryReport:
    """Run ``fn(*args, **kwargs)`` once and return its peak memory with a breakdown.

    ``module`` / ``optimizer`` are found among ``args`` when not given. See :func:`track_memory`
    for the meaning of each argument and category.

    Args:
        fn: the work to measure, e.g. one training step.
        *args: positional arguments for ``fn``.
        module: model(s) whose state is categorised. Default: the ``nn.Module`` objects in ``args``.
        optimizer: optimizer(s) whose state is categorised. Default: optimizers in ``args``.
        device: device type to count. Default: inferred (see :func:`track_memory`).
        **kwargs: keyword arguments for ``fn``.

    Returns:
        A :class:`MemoryReport`; ``report.meta["result"]`` is not kept (the result is discarded).

    Raises:
        TypeError: ``fn`` is not callable.

    Example::

        >>> model = torch.nn.Linear(1024, 1024)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> def step(batch):
        ...     model(batch).sum().backward()
        ...     opt.step()
        >>> report = measure_memory(step, torch.randn(4, 1024), module=model, optimizer=opt)
        >>> report.breakdown["optimizer_state"] >= 2 * report.breakdown["parameters"]
        True
    """
    if not callable(fn):
        raise TypeError(
            f"`fn` must be callable (e.g. a function running one training step), got {type(fn).__name__}: {fn!r}"
        )
    if module is None:
        module = [a for a in args if isinstance(a, nn.Module)] or None
    if optimizer is None:
        optimizer = [a for a in args if isinstance(a, torch.optim.Optimizer)] or None
    with track_memory(module, optimizer, device=device) as tracking:
        fn(*args, **kwargs)
    assert tracking.report is not None
    return tracking.report


def mark_memory(tensor: torch.Tensor, category: str) -> None:
    """Tell the active tracker (if any) that ``tensor``'s storage belongs to ``category``.

    For code that creates state the tracker cannot recognise on its own (e.g. a custom optimizer that
    keeps state outside ``optimizer.state``). A no-op when nothing is being tracked.

    Raises:
        ValueError: ``category`` is not one of the report's categories.
    """
    if category not in CATEGORIES:
        raise ValueError(f"`category`={category!r} is not a memory category; choose from {list(CATEGORIES)}")
    tracker = active_tracker()
    if tracker is not None:
        tracker.mark(tensor, category)


def state_bytes(module: nn.Module | None = None, optimizers: list[Any] | tuple[Any, ...] = ()) -> dict[str, int]:
    """Bytes held right now by ``module``'s parameters (and buffers), their ``.grad`` and optimizer state.

    A cheap walk over known tensors (no tracking), for per-step monitoring. Storages shared between
    tensors are counted once.

    Example::

        >>> state_bytes(torch.nn.Linear(10, 10))["parameters"]
        440
    """
    from lightning_lowmem.memory._tensors import iter_tensors, optimizer_state_tensors

    seen: set[tuple[str, int]] = set()
    totals = {"parameters": 0, "gradients": 0, "optimizer_state": 0}

    def add(category: str, tensors: Any) -> None:
        for tensor in tensors:
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = (tensor.device.type, storage.data_ptr() or id(storage))
            if key not in seen:
                seen.add(key)
                totals[category] += storage.nbytes()

    if module is not None:
        add("parameters", iter_tensors(list(module.parameters()) + list(module.buffers())))
        add("gradients", iter_tensors([p.grad for p in module.parameters() if p.grad is not None]))
    for optimizer in optimizers:
        add("optimizer_state", optimizer_state_tensors(optimizer))
    return totals
