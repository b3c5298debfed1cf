"""Fake tensors and dispatch modes: the estimator's fake step and its value questions.

Each function names the private name it uses (of torch, Lightning, transformers or torchao) and why no public
API does the job.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["data_dependent_errors", "fake_tensor_mode", "is_fake", "no_dispatch_modes", "op_mutates"]


def fake_tensor_mode(**kwargs: Any) -> Any:
    """Return a new ``FakeTensorMode``.

    Why private: FakeTensorMode lives in ``torch._subclasses``; it is the supported way (used by
    ``torch.export`` and torch's own memory tools) to run real ops on tensors that hold no data.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def is_fake(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is a FakeTensor (see :func:`fake_tensor_mode`)."""
    return isinstance(tensor, FakeTensor)


def no_dispatch_modes() -> Any:
    """A context with no ``TorchDispatchMode`` active (no fake mode, no tracker): ops run for real, unseen.

    Why private: ``torch.utils._python_dispatch._disable_current_modes`` is the one way to step out of every
    active mode from inside a mode's ``__torch_dispatch__``; the estimator runs the batch's mask arithmetic on
    the real batch there (``planning/_batch_values.py``).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def op_mutates(func: Any) -> bool:
    """True when the aten overload ``func`` writes to one of its arguments (in-place or ``out=``).

    Why private: an ``OpOverload`` tells it only through its ``_schema`` (``FunctionSchema.is_mutable``).
    """
    schema = getattr(func, "_schema", None)
    return bool(getattr(schema, "is_mutable", False))


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
