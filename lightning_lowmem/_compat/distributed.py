"""torch.distributed: FSDP2's storage resizes and collectives, the fake process group.

Each function names the private name it uses (of torch, Lightning, transformers or torchao) and why no public
API does the job.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["around_fsdp_collectives", "fake_process_group_store", "fsdp_collective_names", "on_fsdp_storage_resize"]


_FSDP_RESIZE_LISTENERS: list[Any] = []


def on_fsdp_storage_resize(listener: Any) -> None:
    """Call ``listener(tensor)`` after FSDP2 allocates or frees the storage behind ``tensor`` in place.

    Why private: FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each unsharded parameter and
    all-gather output as a tensor whose *storage* it resizes (``untyped_storage().resize_(n)`` / ``(0)``
    in ``_fsdp_param.alloc_storage`` / ``free_storage``). A storage resize is no tensor op, so a
    ``TorchDispatchMode`` never sees it; the memory core would count every unsharded parameter as
    alive for good. Wrapping the two module-level helpers (also imported by name into
    ``_fsdp_param_group``) is the only hook there is. Idempotent per listener.
    """
    if listener in _FSDP_RESIZE_LISTENERS:
        return
    _FSDP_RESIZE_LISTENERS.append(listener)
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    if getattr(_fsdp_param.alloc_storage, "_lowmem_wrapped", False):
        return

    def notify(original: Any) -> Any:
        def resize(tensor: torch.Tensor) -> None:
            original(tensor)
            for callback in _FSDP_RESIZE_LISTENERS:
                callback(tensor)

        resize._lowmem_wrapped = True  # type: ignore[attr-defined]
        return resize

    alloc, free = notify(_fsdp_param.alloc_storage), notify(_fsdp_param.free_storage)
    _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc, free
    if getattr(_fsdp_param_group, "alloc_storage", None) is not None:
        _fsdp_param_group.alloc_storage = alloc


_COLLECTIVE_CONTEXTS: list[Any] = []


def around_fsdp_collectives(context: Any) -> None:
    """Run every ``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` (torch 2.11:
    ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, :func:`fsdp_collective_names`) inside ``context(kind,
    output, input)`` (a context-manager factory; ``kind`` is ``"all_gather"`` or ``"reduce_scatter"``).

    Why private: these two are what FSDP2's default communication (``_fsdp_collectives.DefaultAllGather``
    / ``DefaultReduceScatter``) calls, looked up on ``torch.distributed`` at each call; wrapping them is
    how the memory core learns that a backend may allocate in its own thread during the call (gloo's
    reduce-scatter reduces a copy of its input). Idempotent per context.
    """
    if context in _COLLECTIVE_CONTEXTS:
        return
    _COLLECTIVE_CONTEXTS.append(context)
    import contextlib
    import inspect

    import torch.distributed as dist

    def wrap(kind: str, original: Any) -> Any:
        if getattr(original, "_lowmem_wrapped", False):
            return original

        signature = inspect.signature(original)

        def collective(*args: Any, **kwargs: Any) -> Any:
            output, input = list(signature.bind(*args, **kwargs).arguments.values())[:2]
            with contextlib.ExitStack() as stack:
                for factory in _COLLECTIVE_CONTEXTS:
                    stack.enter_context(factory(kind, output, input))
                return original(*args, **kwargs)

        collective._lowmem_wrapped = True  # type: ignore[attr-defined]
        collective.__wrapped__ = original  # type: ignore[attr-defined]
        return collective

    for kind, name in fsdp_collective_names().items():
        setattr(dist, name, wrap(kind, getattr(dist, name)))


def fsdp_collective_names() -> dict[str, str]:
    """``{"all_gather": name, "reduce_scatter": name}``: the ``torch.distributed`` functions FSDP2 calls.

    torch 2.13 has ``all_gather_single`` / ``reduce_scatter_single``; torch 2.11 neither, and FSDP2 calls
    ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (the same leading ``(output, input)`` arguments).
    """
    import torch.distributed as dist

    if hasattr(dist, "all_gather_single"):
        return {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}
    return {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}


def fake_process_group_store() -> Any:
    """A store for ``torch.distributed.init_process_group("fake", store=..., rank=0, world_size=N)``; registers
    torch's "fake" backend first (once): one process plays a rank of N, its collectives communicate nothing.

    Why private: the fake process group (``torch._C._distributed_c10d.FakeProcessGroup``) is registered as a
    backend only by ``torch.testing._internal.distributed.fake_pg``, test code a library must not import; this
    does what that module does (the estimator simulates FSDP ranks with it, ``planning/sharding.py``).
    """
    import torch.distributed as dist
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common_opts: Any, backend_opts: Any) -> Any:
        try:
            return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)
        except TypeError:  # a torch whose fake group takes no backend options
            return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size)

    if "FAKE" not in dist.Backend._plugins:
        dist.Backend.register_backend("fake", create, extended_api=True, devices=["cpu", "cuda", "hpu", "xpu"])
    return dist.HashStore()
