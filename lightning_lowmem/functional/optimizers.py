"""Build optimizers by name: the single switch that memory-lean optimizers plug into."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

_BUILDERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": lambda params, **kw: torch.optim.AdamW(params, **kw),
    "adam": lambda params, **kw: torch.optim.Adam(params, **kw),
    "sgd": lambda params, **kw: torch.optim.SGD(params, **{"momentum": 0.9, **kw}),
}


def available_optimizers() -> list[str]:
    """Names accepted by :func:`build_optimizer`."""
    return sorted(_BUILDERS)


def build_optimizer(name: str, params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """Create the optimizer called ``name`` over ``params``.

    Args:
        name: one of :func:`available_optimizers` (case-insensitive).
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        **kwargs: optimizer arguments (``lr``, ``weight_decay``, ...).

    Raises:
        ValueError: ``name`` is unknown.

    Example::

        >>> opt = build_optimizer("adamw", torch.nn.Linear(2, 2).parameters(), lr=1e-3)
        >>> type(opt).__name__
        'AdamW'
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in _BUILDERS:
        raise ValueError(f"`optimizer`={name!r} is unknown; choose one of {available_optimizers()}")
    if key == "sgd":
        kwargs.pop("weight_decay", None) if kwargs.get("weight_decay") is None else None
    return _BUILDERS[key](params, **kwargs)
