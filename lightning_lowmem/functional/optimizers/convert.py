"""Replace built optimizers by the one an :class:`~lightning_lowmem.functional.config.OptimizerConfig` names.

What ``configure_optimizers`` returned (optimizers, LR schedulers, in any nesting of lists / tuples / dicts)
is walked; every optimizer becomes the config's over the same param groups, keeping each group's ``lr`` and
``weight_decay`` unless the config sets them, and every LR scheduler is re-bound to the new optimizer. The
``MemoryEfficientOptimizer`` callback (inside ``configure_optimizers``) and the low-memory strategies (in
``setup_optimizers``) both convert with this.

Example::

    >>> import torch
    >>> from lightning_lowmem.functional.config import OptimizerConfig
    >>> layer = torch.nn.Linear(4, 4)
    >>> old = torch.optim.AdamW(layer.parameters(), lr=0.01)
    >>> converted = convert_optimizers([old], OptimizerConfig("sgd"))
    >>> type(converted.configured[0]).__name__, converted.configured[0].param_groups[0]["lr"]
    ('SGD', 0.01)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

__all__ = ["Converted", "convert_optimizers", "drop_frozen_"]

GROUP_KEYS_KEPT = ("lr", "weight_decay")


@dataclass
class Converted:
    """``configured`` with its optimizers replaced; ``replaced``: the new optimizers, in order."""

    configured: Any
    replaced: list[torch.optim.Optimizer] = field(default_factory=list)


def convert_optimizers(configured: Any, config: Any, info: Callable[[str], None] | None = None) -> Converted:
    """Replace every optimizer in ``configured`` by ``config``'s (an ``OptimizerConfig``); see the module docstring.

    Args:
        configured: what ``configure_optimizers`` returned, or any nesting of optimizers and LR schedulers.
        config: the :class:`~lightning_lowmem.functional.config.OptimizerConfig` to build.
        info: called with one line per replaced optimizer. Default: ``None``.

    Returns:
        A :class:`Converted`; LR schedulers are changed in place (``scheduler.optimizer``).
    """
    from lightning_lowmem.functional.optimizers.catalog import build_optimizer

    kwargs = config.kwargs
    mapping: dict[int, torch.optim.Optimizer] = {}
    result = Converted(configured)

    def swap(old: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if id(old) not in mapping:
            kept = [k for k in GROUP_KEYS_KEPT if k not in kwargs]  # explicit arguments win
            groups = [{"params": g["params"], **{k: g[k] for k in kept if k in g}} for g in old.param_groups]
            new = build_optimizer(config.name, groups, **kwargs)
            for old_group, new_group in zip(old.param_groups, new.param_groups, strict=True):
                if "initial_lr" in old_group:  # set by schedulers created on the old optimizer
                    initial = new_group["lr"] if "lr" in kwargs else old_group["initial_lr"]
                    # torchao keeps `lr` as a tensor that schedulers fill in place: a shared one would
                    # make the schedule's base decay with it (LambdaLR compounding, lost on resume)
                    new_group["initial_lr"] = initial.clone() if isinstance(initial, torch.Tensor) else initial
            mapping[id(old)] = new
            result.replaced.append(new)
            if info is not None:
                info(f"{type(old).__name__} -> {type(new).__name__}")
        return mapping[id(old)]

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.optim.Optimizer):
            return swap(obj)
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v) for v in obj)
        if isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):  # LR scheduler
            obj.optimizer = swap(obj.optimizer)
            if "lr" in kwargs and hasattr(obj, "base_lrs"):  # schedule from the new lr
                obj.base_lrs = [group["initial_lr"] for group in obj.optimizer.param_groups]
        return obj

    result.configured = walk(configured)
    return result


def drop_frozen_(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Take the parameters that do not require grad out of every param group; returns how many.

    Example::

        >>> frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
        >>> adapter = torch.nn.Parameter(torch.zeros(2))
        >>> optimizer = torch.optim.SGD([frozen, adapter], lr=0.1)
        >>> drop_frozen_([optimizer]), len(optimizer.param_groups[0]["params"])
        (1, 1)
    """
    removed = 0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            kept = [p for p in group["params"] if p.requires_grad]
            removed += len(group["params"]) - len(kept)
            group["params"] = kept
    return removed
