"""``memory_budget=`` for the low-memory strategies: plan a technique mix that fits, before training.

The strategy takes one training batch, asks :func:`~lightning_lowmem.memory.plan.plan_memory` for the
cheapest :class:`~lightning_lowmem.memory.estimate.TrainingConfig` whose estimated peak fits, and
applies it with the same transforms as the explicit options. What the user set explicitly
(``precision``, ``activation_checkpointing``, ``activation_compression``, ``optimizer``) is kept
fixed; the planner searches the rest. Micro-batching is the last resort: only when no configuration
fits whole batches does the planner also try micro-batches (B/2, B/4, ..., 1), which the strategy then
runs with :class:`~lightning_lowmem.callbacks.auto_microbatch.AutoMicrobatch` (same effective batch,
same optimizer steps). Not with an optimizer-in-backward, which steps on every backward.
"""

from __future__ import annotations

from typing import Any

from lightning_lowmem.memory.estimate import PRECISIONS

__all__ = ["plan_for_budget"]


def plan_for_budget(
    module: Any,
    batch: Any,
    budget: int | str,
    *,
    device: str,
    precision: str,
    optimizer: str,
    fixed: dict[str, Any],
) -> Any:
    """Plan a technique mix for ``module`` on ``batch`` within ``budget``.

    Args:
        module: the LightningModule (not modified).
        batch: one training batch.
        budget: the strategy's ``memory_budget`` as the user gave it (bytes or a string).
        device: ``"cuda"`` or ``"cpu"``.
        precision: the precision the run is configured with (the plan's baseline).
        optimizer: the optimizer name the run is configured with (the plan's baseline).
        fixed: the options the user set explicitly: keys among ``precision``,
            ``activation_checkpointing``, ``activation_compression``, ``optimizer``.

    Returns:
        A :class:`~lightning_lowmem.memory.plan.Plan`; ``config.micro_batch_size`` is ``None`` unless
        whole batches cannot fit.

    Raises:
        ValueError: no configuration fits; the message names the budget and the smallest estimate.
    """
    from lightning_lowmem.memory.plan import plan_memory

    if precision not in PRECISIONS:
        precision = "32-true"
    axes: dict[str, Any] = {}
    if "precision" in fixed:
        axes["precisions"] = [fixed["precision"]]
    if "activation_checkpointing" in fixed:
        axes["checkpointing"] = [fixed["activation_checkpointing"]]
    if "activation_compression" in fixed:
        axes["compressions"] = [fixed["activation_compression"]]
    if "optimizer" in fixed:
        axes["optimizers"] = [fixed["optimizer"]]

    def plan(micro_batch_sizes: list[int | None] | None) -> Any:
        return plan_memory(module, batch, budget, device=device, precision=precision, optimizer=optimizer,
                           micro_batch_sizes=micro_batch_sizes, **axes)  # fmt: skip

    try:
        return plan([None])
    except ValueError as whole_batches:
        if "in_backward" in optimizer:
            raise ValueError(
                f"LowMemoryStrategy(memory_budget={budget!r}) cannot train {type(module).__name__} within the budget: "
                f"{whole_batches} Micro-batches are not tried with optimizer={optimizer!r} (it steps on every "
                "backward): a smaller DataLoader batch_size lowers the activations."
            ) from whole_batches
        try:
            return plan(None)  # None: the planner's micro-batch sizes B/2, B/4, ..., 1 as well
        except ValueError as err:
            raise ValueError(
                f"LowMemoryStrategy(memory_budget={budget!r}) cannot train {type(module).__name__} within the "
                f"budget, not even in micro-batches of 1 sample: {err}"
            ) from err
