"""``memory_budget=`` for the low-memory strategies: plan a technique mix that fits, before training.

The strategy takes one training batch and calls :func:`~lightning_lowmem.planning.plan.plan_memory` -- the
same function, with the same defaults, as ``plan_memory`` itself and ``lowmem estimate --budget`` -- for
the cheapest :class:`~lightning_lowmem.planning.estimate.TrainingConfig` whose estimated peak fits, and
applies it with the same transforms as the explicit options. What the user set explicitly
(``precision``, ``activation_checkpointing``, ``activation_compression``, ``optimizer``) is kept fixed;
the planner searches the rest. The optimizer ``configure_optimizers`` returns is the baseline: an AdamW /
Adam may become 8-bit AdamW (same learning rate), nothing else changes family. Micro-batching is the
last resort (only when no whole-batch mix fits), run with
:class:`~lightning_lowmem.callbacks.auto_microbatch.AutoMicrobatch`; never with an optimizer-in-backward.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_lowmem.planning.estimate import PRECISIONS

__all__ = ["plan_for_budget", "planner_axes"]


def planner_axes(fixed: dict[str, Any]) -> dict[str, list[Any]]:
    """The :func:`plan_memory` axes that keep the strategy's explicit options fixed."""
    names = {"precision": "precisions", "activation_checkpointing": "checkpointing",
             "activation_compression": "compressions", "optimizer": "optimizers"}  # fmt: skip
    return {names[key]: [value] for key, value in fixed.items() if key in names}


def plan_for_budget(
    module: Any,
    batch: Any,
    budget: int | str,
    *,
    device: str,
    precision: str,
    optimizer: str | None,
    fixed: dict[str, Any],
    optimizer_kwargs: dict[str, Any] | None = None,
    progress: Callable[[Any, int, int], None] | None = None,
) -> Any:
    """Plan a technique mix for ``module`` on ``batch`` within ``budget``.

    Args:
        module: the LightningModule (not modified).
        batch: one training batch.
        budget: the strategy's ``memory_budget`` as the user gave it (bytes or a string).
        device: ``"cuda"`` or ``"cpu"``.
        precision: the precision the run is configured with (the plan's baseline).
        optimizer: the strategy's ``optimizer`` option, or ``None``: the one ``configure_optimizers``
            returns (the plan's baseline, see :func:`plan_memory`).
        fixed: the options the user set explicitly: keys among ``precision``,
            ``activation_checkpointing``, ``activation_compression``, ``optimizer``.
        optimizer_kwargs: the strategy's ``optimizer_kwargs``. Default: none.
        progress: passed to :func:`plan_memory`. Default: ``None``.

    Returns:
        A :class:`~lightning_lowmem.planning.plan.Plan`; ``config.micro_batch_size`` is ``None`` unless
        whole batches cannot fit.

    Raises:
        ValueError: no configuration fits; the message names the budget and the smallest estimate.
    """
    from lightning_lowmem.planning.plan import plan_memory

    if precision not in PRECISIONS:
        precision = "32-true"
    try:
        return plan_memory(module, batch, budget, device=device, precision=precision, optimizer=optimizer,
                           optimizer_kwargs=optimizer_kwargs, progress=progress, **planner_axes(fixed))  # fmt: skip
    except ValueError as err:
        if optimizer is not None and "in_backward" in optimizer:
            raise ValueError(
                f"LowMemoryStrategy(memory_budget={budget!r}) cannot train {type(module).__name__} within the budget: "
                f"{err} Micro-batches are not tried with optimizer={optimizer!r} (it steps on every backward): a "
                "smaller DataLoader batch_size lowers the activations."
            ) from err
        raise ValueError(
            f"LowMemoryStrategy(memory_budget={budget!r}) cannot train {type(module).__name__} within the budget, "
            f"not even in micro-batches of 1 sample: {err}"
        ) from err
