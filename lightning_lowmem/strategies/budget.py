"""``memory_budget=`` for the low-memory strategies: plan a technique mix that fits, before training.

The strategy takes one training batch and calls :func:`~lightning_lowmem.planning.plan.plan_memory` -- the
same function, with the same defaults, as ``plan_memory`` itself and ``lowmem estimate --budget`` -- for
the cheapest technique mix whose estimated peak fits, and yields the :class:`~lightning_lowmem.functional.config.TrainingConfig` the strategy then applies
(:func:`applied_plan`), exactly as it applies explicit options. What the user set explicitly
(``precision``, ``activation_checkpointing``, ``activation_compression``, ``optimizer``: the strategy's
``explicit`` config) is kept fixed; the planner searches the rest, with the strategy's
``nested_checkpointing`` / ``compression_min_bytes`` on the techniques it tries. The optimizer
``configure_optimizers`` returns is the baseline: an AdamW / Adam may become 8-bit AdamW (same learning
rate), nothing else changes family. Micro-batching is the last resort (only when no whole-batch mix
fits), run by the strategy with :class:`~lightning_lowmem.functional.microbatch.MicrobatchLoop`
(``AutoMicrobatch``'s loop); never with an optimizer-in-backward.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_lowmem.functional.config import PRECISIONS, CompressionConfig, OptimizerConfig, TrainingConfig

__all__ = ["applied_plan", "plan_for_budget"]


def plan_for_budget(
    module: Any,
    batch: Any,
    budget: int | str,
    *,
    device: str,
    precision: str,
    config: TrainingConfig,
    settings: TrainingConfig | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    progress: Callable[[Any, int, int], None] | None = None,
    accumulate_grad_batches: int = 1,
) -> Any:
    """Plan a technique mix for ``module`` on ``batch`` within ``budget``.

    Args:
        module: the LightningModule (not modified).
        batch: one training batch.
        budget: the strategy's ``memory_budget`` as the user gave it (bytes or a string).
        device: ``"cuda"`` or ``"cpu"``.
        precision: the precision the run is configured with (the plan's baseline).
        config: the options set explicitly (``None`` fields: searched; ``optimizer=None``: the one
            ``configure_optimizers`` returns is the baseline, see :func:`plan_memory`).
        settings: a config whose ``checkpointing`` / ``compression`` carry the settings (``nested``,
            ``min_bytes``) of the techniques the planner tries. Default: the defaults.
        optimizer_kwargs: when ``config.optimizer`` is ``None``, arguments that replace those of the optimizer
            ``configure_optimizers`` returns (``plan_memory(optimizer=None, optimizer_kwargs=...)``); a named
            optimizer's hyperparameters are in ``config.optimizer`` (an ``OptimizerConfig``). Default: none.
        progress: passed to :func:`plan_memory`. Default: ``None``.
        accumulate_grad_batches: the Trainer's; the plan estimates that many batches per optimizer step (their
            gradients alive through the later ones). Default: 1.

    Returns:
        A :class:`~lightning_lowmem.planning.plan.Plan`; ``config.micro_batch_size`` is ``None`` unless
        whole batches cannot fit.

    Raises:
        ValueError: no configuration fits; the message names the budget and the smallest estimate.
    """
    from lightning_lowmem.planning.plan import plan_memory

    if precision not in PRECISIONS:
        precision = "32-true"
    axes: dict[str, list[Any]] = {}
    if settings is not None and config.checkpointing is None and settings.checkpointing is not None:
        axes["checkpointing"] = [None, settings.checkpointing]  # plan_memory's default axis, as the run applies it
    if settings is not None and config.compression is None and settings.compression is not None:
        min_bytes = settings.compression.min_bytes
        axes["compressions"] = [None, CompressionConfig("bf16", min_bytes), CompressionConfig("int8", min_bytes)]
    try:
        return plan_memory(
            module,
            batch,
            budget,
            device=device,
            precision=precision,
            config=config,
            optimizer_kwargs=None if config.optimizer is not None else optimizer_kwargs,
            progress=progress,
            accumulate_grad_batches=accumulate_grad_batches,
            **axes,
        )
    except ValueError as err:
        if config.optimizer is not None and config.optimizer.in_backward:
            raise ValueError(
                f"LowMemoryStrategy(memory_budget={budget!r}) cannot train {type(module).__name__} within the budget: "
                f"{err} Micro-batches are not tried with optimizer={config.optimizer.name!r} (it steps on every "
                "backward): a smaller DataLoader batch_size lowers the activations."
            ) from err
        raise ValueError(
            f"LowMemoryStrategy(memory_budget={budget!r}) cannot train {type(module).__name__} within the budget, "
            f"not even in micro-batches of 1 sample: {err}"
        ) from err


def applied_plan(
    plan: Any, explicit: TrainingConfig, configured_precision: str, optimizer_kwargs: dict[str, Any] | None = None
) -> TrainingConfig:
    """The :class:`TrainingConfig` a strategy applies for ``plan``: the chosen mix, with ``precision`` left to
    the Trainer when the plan keeps the configured one, and the optimizer left as configured unless the plan
    changes it (a new one gets the plan's learning rate and the explicit arguments it accepts)."""
    from lightning_lowmem.functional.optimizers.catalog import optimizer_arguments

    chosen = plan.config
    precision = chosen.precision if chosen.precision_preset != configured_precision else explicit.precision
    optimizer = explicit.optimizer
    baseline = plan.baseline.config.optimizer_name if plan.baseline is not None else chosen.optimizer_name
    if chosen.optimizer_name != baseline:
        accepted = set(optimizer_arguments(chosen.optimizer_name))
        given = {**(optimizer_kwargs or {}), **(explicit.optimizer.kwargs if explicit.optimizer else {})}
        kept = {k: v for k, v in given.items() if k in accepted}
        optimizer = OptimizerConfig(chosen.optimizer_name, {**plan.optimizer_kwargs, **kept})  # a new family's lr
    return chosen.replace(precision=precision, optimizer=optimizer)
