"""`plan_memory`: the cheapest technique mix whose estimated peak fits a memory budget.

Candidates are ranked by a prior slowdown and predicted in that order from per-axis measurements
(:mod:`lightning_lowmem.planning._components`: one model-side run per precision / checkpointing /
compression / micro-batch / LoRA / chunked-loss setting, one optimizer profile per optimizer and trainable-parameter
set); the first that fits is re-estimated in full (:func:`estimate_memory`), and chosen if the full
estimate fits too. ``plan_memory``, ``lowmem estimate --budget`` and ``LowMemoryStrategy(memory_budget=)``
all call this one function, so they choose the same plan for the same model, batch and options. The search
itself, step by step, is :class:`~lightning_lowmem.planning.search.PlanSearch`; its axes are the table
:data:`~lightning_lowmem.planning.axes.AXES`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from lightning_lowmem.functional.config import OptimizerConfig
from lightning_lowmem.planning.estimate import TrainingConfig
from lightning_lowmem.planning.plan_report import Candidate, Plan
from lightning_lowmem.planning.priors import (  # noqa: F401  (re-exported: plan.SLOWDOWN, plan.expected_slowdown)
    DEFAULT_LR,
    SLOWDOWN,
    expected_slowdown,
    numerics_caveat,
)
from lightning_lowmem.planning.search import Progress

__all__ = ["DEFAULT_LR", "SLOWDOWN", "Candidate", "Plan", "Progress", "expected_slowdown", "plan_memory"]


def plan_memory(
    module: nn.Module,
    batch: Any,
    budget: int | str | None = None,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    optimizer: str | OptimizerConfig | None = None,
    precision: str = "32-true",
    device: str = "cuda",
    margin: float = 0.1,
    precisions: Iterable[str] | None = None,
    checkpointing: Iterable[Any] | None = None,
    compressions: Iterable[str | None] | None = None,
    optimizers: Iterable[str] | None = None,
    micro_batch_sizes: Iterable[int | None] | None = None,
    loras: Iterable[dict[str, Any] | None] | None = None,
    cross_entropies: Iterable[str | None] | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    config: TrainingConfig | None = None,
    world_size: int = 1,
    shardings: Iterable[str] | None = None,
    max_estimates: int = 60,
    include_overheads: bool = False,
    loop: str = "auto",
    progress: Progress | None = None,
    attention_kernel: str = "auto",
    full_check: str = "always",
    accumulate_grad_batches: int = 1,
    gpu: str | None = None,
) -> Plan:
    """Find the technique mix with the lowest expected slowdown whose estimated peak fits ``budget``.

    Every combination of the search axes is ranked by :func:`expected_slowdown` and predicted in that
    order until one fits. Predictions combine per-axis measurements on fake tensors (nothing is
    allocated): one run of the model side per precision / checkpointing / compression / micro-batch /
    LoRA setting, one profile per optimizer, so most candidates cost no new run. The first candidate
    whose prediction fits is re-estimated with the full :func:`estimate_memory` and chosen if that fits
    too (``plan.chosen.report`` is that full estimate; ``plan.chosen.per_axis_peak_bytes`` the
    prediction). A model-side run stops as soon as it passes the budget (that candidate cannot fit, with
    any optimizer), and when the fastest candidate does not fit the leanest model side is checked first,
    so an impossible budget fails fast.

    Micro-batches are the last resort: they are searched only when no whole-batch mix fits (a step
    then sees fewer samples at a time, which changes batch statistics such as BatchNorm's), and never
    with an optimizer-in-backward (it steps on every backward). The optimizer stays in its family by
    default: the configured one, plus 8-bit AdamW for AdamW / Adam (same hyperparameters and learning
    rate). Other optimizers are searched only when listed in ``optimizers``; a plan that changes the
    family sets that family's learning rate in ``plan.optimizer_kwargs`` (:data:`DEFAULT_LR`).

    Args:
        module: the model (it is not modified).
        batch: one batch (tensors may be on ``meta``).
        budget: bytes, or a string like ``"8GiB"`` / ``"512MB"``; ``None`` with ``gpu``: the card's capacity, its
            CUDA context and workspace subtracted (``include_overheads``).
        loss_fn: see :func:`estimate_memory`.
        optimizer: the optimizer the user wants, an :class:`~lightning_lowmem.functional.config.OptimizerConfig`
            (its hyperparameters apply to the candidates of its family that accept them) or a name; the plain
            candidate uses it. ``None``: the one the module's ``configure_optimizers`` returns, with its
            arguments (a type the estimator does not know is estimated as AdamW and never swapped), else AdamW.
            Default: ``None``.
        precision: the precision the user wants. Default: ``"32-true"``.
        device: ``"cuda"`` or ``"cpu"`` (see :func:`estimate_memory`). Default: ``"cuda"``.
        attention_kernel: the CUDA attention kernel, see :func:`estimate_memory`. Default: ``"auto"``.
        margin: share of the budget kept free for what the estimate does not see (fragmentation,
            library workspaces). Default: 0.1.
        precisions, checkpointing, compressions, optimizers, micro_batch_sizes, loras, cross_entropies: search
            axes. Defaults: {precision, bf16-mixed, bf16-true}; {None, "auto"}; {None, bf16, int8};
            {optimizer, adamw8bit if optimizer is adamw / adam}; whole batches, then {B/2, B/4, ..., 1};
            {None}; {None, "chunked"} for a Hugging Face causal LM (whose loss it computes with no change to
            the training step), else {None} (list "chunked" when your step calls ``chunked_cross_entropy``).
            A given ``micro_batch_sizes`` list is searched together with the other axes.
        optimizer_kwargs: a shorthand (:mod:`~lightning_lowmem.planning.optimizer_argument`). Beside
            ``optimizer=None``: arguments that replace the configured optimizer's own (e.g. ``{"lr": 0.1}``;
            those it does not take are dropped). Beside a name (or ``config``'s optimizer): its hyperparameters,
            deprecated (a ``DeprecationWarning``) -- give ``OptimizerConfig(name, **hyperparameters)``.
            Default: none.
        config: a :class:`TrainingConfig` whose set techniques stay fixed (each becomes a one-value axis;
            its optimizer, hyperparameters included, replaces ``optimizer``); ``None`` fields (``precision=None``,
            ``optimizer=None``, techniques off) are searched as without it. This is how
            ``LowMemoryStrategy(memory_budget=)`` keeps the options set explicitly. Default: ``None``.
        world_size: processes (GPUs) the step runs on; above 1 the plan is for one rank, ``budget`` is per GPU,
            ``batch`` is one rank's batch, and the sharding is a search axis. Default: 1.
        shardings: the sharding axis for ``world_size`` > 1, a subset of ``"ddp"``, ``"zero1"``, ``"fsdp"``
            (ranked in that order of communication, see :data:`SLOWDOWN`). Sharded candidates are estimated in
            full (:func:`estimate_memory` with ``world_size`` / ``sharding``: per-rank figures, the ranks
            simulated in this process). Default: all three; a ``config`` with ``sharding`` fixes it.
        max_estimates: stop searching after this many runs on fake tensors (model-side runs and full
            estimates; the fastest fitting candidate found so far is chosen). Default: 60.
        include_overheads: also subtract the CUDA context / workspace from the budget (set when the
            budget is the card's total memory rather than what torch may allocate). Default: ``False``.
        loop: the step order estimated (see :func:`estimate_memory`). Default: ``"auto"``.
        full_check: ``"always"``: the chosen candidate's prediction is re-estimated in full (:func:`estimate_memory`)
            and the full figure decides; ``"near-budget"``: only when the prediction is above 98% of the usable memory
            (otherwise ``plan.chosen.report`` is the per-axis prediction; ``lowmem estimate`` uses it: the answer in
            seconds). Default: ``"always"``.
        accumulate_grad_batches: as ``Trainer(accumulate_grad_batches=N)``, see :func:`estimate_memory`; the
            optimizers-in-backward are left out of the search. Default: 1.
        gpu: the card (see :func:`estimate_memory`; implies ``device="cuda"``): its context and workspace are the
            overheads, and the chosen plan's report carries ``meta["gpu"]``. Default: ``None``.
        progress: ``progress(candidate, index, total)`` after each prediction (e.g. to update a progress
            bar); every prediction is also logged on this module's logger at INFO. Default: ``None``.

    Returns:
        A :class:`Plan`.

    Raises:
        ValueError: the budget does not parse, or no candidate fits (the message names the smallest
            predicted peak and the configuration that reached it); from ``OptimizerConfig``: an optimizer
            argument it does not take or a value it refuses.
        EstimationError: the model's step cannot run on fake tensors.

    Example::

        >>> from lightning_lowmem.demo import CharLM
        >>> model = CharLM(n_layer=2, n_embd=64, block_size=32)
        >>> batch = (torch.zeros(8, 32, dtype=torch.long),) * 2
        >>> plan = plan_memory(model, batch, "1GiB", device="cpu")
        >>> plan.config.describe()
        '32-true + adamw'
    """
    from lightning_lowmem.planning.search import PlanSearch

    axes = {
        "precisions": precisions,
        "checkpointing": checkpointing,
        "compressions": compressions,
        "optimizers": optimizers,
        "micro_batch_sizes": micro_batch_sizes,
        "loras": loras,
        "cross_entropies": cross_entropies,
        "shardings": shardings,
    }
    search = PlanSearch(
        module,
        batch,
        budget,
        loss_fn=loss_fn,
        optimizer=optimizer,
        precision=precision,
        device=device,
        margin=margin,
        axes=axes,
        optimizer_kwargs=optimizer_kwargs,
        config=config,
        world_size=world_size,
        max_estimates=max_estimates,
        include_overheads=include_overheads,
        loop=loop,
        progress=progress,
        attention_kernel=attention_kernel,
        full_check=full_check,
        accumulate_grad_batches=accumulate_grad_batches,
        gpu=gpu,
    )
    return search.run()
