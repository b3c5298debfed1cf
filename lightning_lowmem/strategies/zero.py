"""ZeRO-1 for ``LowMemoryDDPStrategy``: shard optimizer state across processes with torch's
``ZeroRedundancyOptimizer``, keeping the optimizer the LightningModule configured.

Each process keeps the state (e.g. AdamW's two moments) of about ``1 / world_size`` of the
parameters, steps only those and broadcasts the updated weights. Checkpoints hold the full,
unsharded state: Lightning's ``Strategy.optimizer_state`` calls ``consolidate_state_dict(to=0)``
on every rank and saves rank 0's gathered copy, which loads into the plain optimizer (any world size,
``"lowmem"`` included) or back into a ZeRO wrapper, which keeps only its shard.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

__all__ = ["drop_duplicate_state", "reload_local_state", "shard_optimizer"]


def _accepted(constructor: Callable[..., Any], values: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that ``constructor`` accepts as keyword arguments."""
    try:
        parameters = inspect.signature(constructor).parameters
    except (TypeError, ValueError):  # builtins without a signature: pass everything
        return dict(values)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(values)
    return {key: value for key, value in values.items() if key in parameters}


def shard_optimizer(optimizer: torch.optim.Optimizer, name: str | None = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` in ``ZeroRedundancyOptimizer`` over the same param groups.

    The wrapper rebuilds the optimizer on each rank for that rank's share of every param group, with
    the group's hyperparameters (``lr``, ``weight_decay``, ``betas``, ...). Needs an initialised
    default process group.

    Args:
        optimizer: the optimizer to shard (a ``torch.optim`` class or any class constructible as
            ``type(optimizer)(param_groups, **defaults)``).
        name: the :func:`~lightning_lowmem.functional.optimizers.build_optimizer` name the optimizer
            was built with, if any; the shards are then built by name, so options that are not
            hyperparameters (e.g. ``adamw_bf16_sr``'s stochastic rounding) survive. Default: ``None``.

    Returns:
        The ``ZeroRedundancyOptimizer`` (``optimizer`` itself if it already is one).

    Raises:
        ValueError: ``optimizer`` steps inside backward (an ``*_in_backward`` optimizer): it has no
            ``step`` for ZeRO to shard.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if hasattr(optimizer, "remove_hooks"):  # OptimizerInBackward
        raise ValueError(
            f"`zero_optimizer`=True cannot shard {type(optimizer).__name__}: it steps inside backward. "
            "Use a plain optimizer name (e.g. 'adamw', 'adamw8bit') or zero_optimizer=False."
        )
    if name is not None:
        from lightning_lowmem.functional.optimizers.catalog import build_optimizer

        constructor: Callable[..., Any] = functools.partial(build_optimizer, name)
        kept = ("lr", "weight_decay")  # what build_optimizer's callers pass; the rest is the name's
        defaults = {key: optimizer.defaults[key] for key in kept if key in optimizer.defaults}
        groups = [
            {"params": g["params"], **{k: g[k] for k in (*kept, "initial_lr") if k in g}}
            for g in optimizer.param_groups
        ]
    else:
        constructor = type(optimizer)
        defaults = _accepted(constructor, optimizer.defaults)
        groups = [dict(group) for group in optimizer.param_groups]  # every hyperparameter, per group
    return ZeroRedundancyOptimizer(groups, optimizer_class=constructor, **defaults)  # type: ignore[arg-type]


def drop_duplicate_state(optimizer: Any) -> None:
    """After ``load_state_dict`` on a ``ZeroRedundancyOptimizer``: drop the wrapper's copy of the state.

    ``ZeroRedundancyOptimizer.load_state_dict`` moves this rank's shard into its local optimizer and
    also keeps the loaded tensors in the wrapper's own ``state``, which nothing reads again (its
    ``state_dict`` is rebuilt from the local optimizers). When the checkpoint was loaded onto another
    device than the parameters' (e.g. ``map_location="cpu"`` for a GPU run) that is a second copy of
    the shard for the rest of the run. A no-op for any other optimizer.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.state.clear()


def reload_local_state(optimizer: Any) -> None:
    """After ``load_state_dict`` on a ``ZeroRedundancyOptimizer``: load its shard into the local optimizer
    through that optimizer's own ``load_state_dict``.

    ``ZeroRedundancyOptimizer.load_state_dict`` writes each of this rank's saved states straight into
    ``local.state[param]``, past the local optimizer's loading: low-bit state stays in the plain-tensor
    form it is saved in (torchao's step then fails on a dict), and a wrapper that links its state to an
    inner optimizer's (``StochasticRounding``) is cut from it. A no-op for any other optimizer.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer) and optimizer.optim.state:
        local = optimizer.optim
        local.load_state_dict(local.state_dict())  # the saved form, loaded as a checkpoint would be
