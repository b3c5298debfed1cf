"""The one place where lightning_lowmem touches private torch / Lightning attributes.

Each function says which private name it uses and why no public API does the job. When torch grows a
public equivalent, only this file changes.
"""

from __future__ import annotations

import collections
from typing import Any

import torch


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread.

    Why private: torch exposes no public "am I inside backward?" query; ``_current_graph_task_id`` is
    what ``torch.utils.checkpoint`` itself uses for the same question. Returns -1 outside backward.
    """
    return torch._C._current_graph_task_id() != -1


def move_post_accumulate_grad_hook_first(param: torch.Tensor, handle: Any) -> None:
    """Make the hook behind ``handle`` run before every other post-accumulate-grad hook of ``param``.

    Why private: ``register_post_accumulate_grad_hook`` has no ``prepend=`` flag, and the memory
    tracker must see ``param.grad`` before an optimizer-in-backward hook steps and frees it. The hooks
    live in the ``OrderedDict`` ``param._post_accumulate_grad_hooks`` keyed by ``handle.id``; autograd
    walks it with ``PyDict_Next`` (plain-dict insertion order, blind to ``move_to_end``), so the dict is
    rebuilt in place with the hook inserted first.
    """
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    if isinstance(hooks, collections.OrderedDict) and handle.id in hooks:
        items = list(hooks.items())
        hooks.clear()
        hooks[handle.id] = dict(items)[handle.id]
        for key, hook in items:
            if key != handle.id:
                hooks[key] = hook


def fake_tensor_mode(**kwargs: Any) -> Any:
    """Return a new ``FakeTensorMode``.

    Why private: FakeTensorMode lives in ``torch._subclasses``; it is the supported way (used by
    ``torch.export`` and torch's own memory tools) to run real ops on tensors that hold no data.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def is_fake(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is a FakeTensor (see :func:`fake_tensor_mode`)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


class inductor_freezing:  # noqa: N801 - used like a function: ``with inductor_freezing(): ...``
    """A context in which ``torch.compile`` treats parameters as constants (Inductor "freezing").

    Freezing lets Inductor pre-pack weights and fuse pt2e int8 patterns into oneDNN ``qlinear`` kernels
    on x86 CPUs; without it a quantized graph runs its reference dequantize/quantize ops.

    Why private: freezing is only switchable through ``torch._inductor.config.freezing``, and dynamo reads
    it while tracing (to inline parameters as constants), so ``torch.compile(options={"freezing": True})``,
    which reaches Inductor only, fails on pt2e int8 graphs (``onednn.qlinear_prepack`` has no fake kernel).
    Setting and restoring the attribute costs about 10 us a call; ``config.patch`` about 85 us.
    """

    def __enter__(self) -> None:
        import torch._inductor.config as inductor_config

        self._previous = inductor_config.freezing
        inductor_config.freezing = True

    def __exit__(self, *exc_info: Any) -> None:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = self._previous


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """Exception types fake tensors raise on data-dependent control flow or output shapes.

    Why private: these exception classes are only importable from ``torch._subclasses`` and
    ``torch.fx.experimental``; the estimator turns them into a clear user-facing error.
    """
    errors: list[type[BaseException]] = []
    try:
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

        errors += [DataDependentOutputException, DynamicOutputShapeException]
    except ImportError:  # pragma: no cover - older torch
        pass
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        errors.append(GuardOnDataDependentSymNode)
    except ImportError:  # pragma: no cover - older torch
        pass
    try:
        from torch._subclasses.fake_tensor import UnsupportedFakeTensorException

        errors.append(UnsupportedFakeTensorException)
    except ImportError:  # pragma: no cover - older torch
        pass
    return tuple(errors)


def cuda_record_memory_history(enabled: bool, max_entries: int = 100_000) -> None:
    """Start / stop the CUDA caching allocator's history recording (for OOM snapshots).

    Why private: ``torch.cuda.memory._record_memory_history`` is the documented entry point of the
    memory-snapshot tool (pytorch.org "Understanding CUDA Memory Usage") but keeps its underscore.
    """
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def cuda_dump_snapshot(path: str) -> None:
    """Write the recorded CUDA allocator history to ``path`` (see :func:`cuda_record_memory_history`)."""
    torch.cuda.memory._dump_snapshot(path)


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of (the root of a chain of views), or ``None``.

    Why private: ``Tensor._base`` is the only way to learn that a saved tensor such as ``weight.t()``
    (what ``addmm`` saves for a Linear) is a view of a parameter; activation compression must leave
    parameters exact and must not copy them.
    """
    return tensor._base


def top_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The ``(pack, unpack)`` pair on top of autograd's saved-tensors hooks stack, or ``None``.

    Why private: ``torch.autograd.graph.saved_tensors_hooks`` *replace* the hooks below them (only the top
    pair runs), and torch has no public getter for that pair; ``_top_saved_tensors_default_hooks`` is what
    AOT autograd itself uses to read it. A hook that only observes (the memory tracker) reads it to pass
    each saved tensor on to the hooks below, so observing a step never changes how it is stored.
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - torch without the getter: observe without passing on
        return None
    return top(True)  # True: ignore whether dynamo is tracing


def force_eager() -> Any:
    """A context in which ``torch.compile``-d functions run their Python code eagerly.

    Needed wherever tensors are fake or a dispatch mode is tracking: a compiled kernel called with fake
    tensors reads memory that does not exist (torchao's low-bit optimizers compile their per-parameter
    step), and compiled frames hide their allocations from a ``TorchDispatchMode``.
    """
    import contextlib

    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    if set_stance is None:
        return contextlib.nullcontext()
    return set_stance("force_eager")
