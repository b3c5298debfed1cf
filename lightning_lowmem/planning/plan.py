"""`plan_memory`: the cheapest technique mix whose estimated peak fits a memory budget.

Candidates are ranked by a prior slowdown and predicted in that order from per-axis measurements
(:mod:`lightning_lowmem.planning._components`: one model-side run per precision / checkpointing /
compression / micro-batch / LoRA setting, one optimizer profile per optimizer and trainable-parameter
set); the first that fits is re-estimated in full (:func:`estimate_memory`), and chosen if the full
estimate fits too. ``plan_memory``, ``lowmem estimate --budget`` and ``LowMemoryStrategy(memory_budget=)``
all call this one function, so they choose the same plan for the same model, batch and options.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Iterable

import torch
from torch import nn

from lightning_lowmem.functional.config.techniques import SHARDINGS, ShardingConfig
from lightning_lowmem.planning._fake_step import tensor_leaves
from lightning_lowmem.planning.estimate import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, EstimationError, TrainingConfig
from lightning_lowmem.planning.plan_report import Candidate, Plan, peak_label
from lightning_lowmem.planning.priors import (  # noqa: F401  (re-exported: plan.SLOWDOWN, plan.expected_slowdown)
    _PRECISION_RANK,
    DEFAULT_LR,
    SLOWDOWN,
    expected_slowdown,
    numerics_caveat,
)
from lightning_lowmem.memory.report import MemoryReport
from lightning_lowmem.memory.units import format_bytes, parse_bytes

__all__ = ["DEFAULT_LR", "SLOWDOWN", "Candidate", "Plan", "expected_slowdown", "plan_memory"]

log = logging.getLogger(__name__)

def _batch_size(batch: Any) -> int | None:
    sizes = {leaf.shape[0] for leaf in tensor_leaves(batch) if leaf.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _family(name: str) -> str:
    from lightning_lowmem.functional.optimizers.registry import state_layout

    return state_layout(name)[0]


def _default_optimizers(optimizer: str) -> list[str]:
    """The configured optimizer and, for the Adam family, 8-bit AdamW (same hyperparameters and lr)."""
    from lightning_lowmem.functional.optimizers.registry import available_optimizers

    names = [optimizer]
    if optimizer in ("adamw", "adam") and "adamw8bit" in available_optimizers():
        names.append("adamw8bit")
    return names


def _stages(
    batch_size: int | None,
    precision: str,
    optimizer: str,
    precisions: Iterable[str] | None,
    checkpointing: Iterable[Any] | None,
    compressions: Iterable[str | None] | None,
    optimizers: Iterable[str] | None,
    micro_batch_sizes: Iterable[int | None] | None,
    loras: Iterable[Any] | None,
    cross_entropies: Iterable[Any] | None = None,
) -> list[list[TrainingConfig]]:
    """The search space in stages: whole batches first; micro-batches only when no whole-batch mix fits
    (unless ``micro_batch_sizes`` is given: then one stage)."""
    precisions = list(precisions or dict.fromkeys([precision, "bf16-mixed", "bf16-true"]))
    checkpointing = list(checkpointing if checkpointing is not None else [None, "auto"])
    compressions = list(compressions if compressions is not None else [None, "bf16", "int8"])
    optimizers = list(optimizers or _default_optimizers(optimizer))
    loras = list(loras if loras is not None else [None])
    cross_entropies = list(cross_entropies if cross_entropies is not None else [None])

    def space(sizes: list[Any]) -> list[TrainingConfig]:
        configs = (
            TrainingConfig(precision=p, checkpointing=c, compression=z, optimizer=o, microbatch=m, lora=lo or None,
                           cross_entropy=ce)
            for p, c, z, o, m, lo, ce in itertools.product(
                precisions, checkpointing, compressions, optimizers, sizes, loras, cross_entropies
            )
        )  # fmt: skip
        # an optimizer-in-backward steps on every backward: no gradient accumulation
        return [config for config in configs if not (config.microbatch is not None and config.optimizer.in_backward)]

    if micro_batch_sizes is not None:
        return [space(list(micro_batch_sizes))]
    halves, size = [], batch_size // 2 if batch_size else 0
    while size >= 1:
        halves.append(size)
        size //= 2
    return [space([None]), space(halves)]


def _leanness(config: TrainingConfig) -> tuple:
    """Sort key: larger = expected to use less memory (every technique at its strongest setting)."""
    return (
        config.lora is not None and bool(config.lora.quantize_base),
        config.lora is not None,
        _PRECISION_RANK.get(config.precision_preset or "32-true", 0),
        config.checkpointing is not None,
        config.cross_entropy is not None,
        {"int8": 3, "cpu": 2, "bf16": 1}.get(config.activation_compression or "", 0),
        {"adamw4bit": 4, "adamw8bit": 3, "adafactor": 2, "sgd": 1}.get(
            (config.optimizer_name or "").removesuffix("_in_backward"), 0
        ),
        -(config.micro_batch_size or 10**9),
    )


Progress = Callable[[Candidate, int, int], None]
"""``progress(candidate, index, total)``: called after each candidate is predicted (``index`` counts from
1; ``total`` is the size of the space being searched, an upper bound: the search stops at the first fit)."""


def plan_memory(
    module: nn.Module,
    batch: Any,
    budget: int | str,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    optimizer: str | None = None,
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
        budget: bytes, or a string like ``"8GiB"`` / ``"512MB"``.
        loss_fn: see :func:`estimate_memory`.
        optimizer: the optimizer the user wants; the plain candidate uses it. ``None``: the one the
            module's ``configure_optimizers`` returns, with its arguments (a type the estimator does not
            know is estimated as AdamW and never swapped), else AdamW. Default: ``None``.
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
        optimizer_kwargs: arguments of the configured optimizer (e.g. ``{"momentum": 0.9}``); they
            apply to candidates of its family that accept them. Default: none.
        config: a :class:`TrainingConfig` whose set techniques stay fixed (each becomes a one-value axis;
            its optimizer's hyperparameters join ``optimizer_kwargs``); ``None`` fields (``precision=None``,
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
        progress: ``progress(candidate, index, total)`` after each prediction (e.g. to update a progress
            bar); every prediction is also logged on this module's logger at INFO. Default: ``None``.

    Returns:
        A :class:`Plan`.

    Raises:
        ValueError: the budget does not parse, or no candidate fits (the message names the smallest
            predicted peak and the configuration that reached it).
        EstimationError: the model's step cannot run on fake tensors.

    Example::

        >>> from lightning_lowmem.demo import CharLM
        >>> model = CharLM(n_layer=2, n_embd=64, block_size=32)
        >>> batch = (torch.zeros(8, 32, dtype=torch.long),) * 2
        >>> plan = plan_memory(model, batch, "1GiB", device="cpu")
        >>> plan.config.describe()
        '32-true + adamw'
    """
    from lightning_lowmem.planning._evaluate import CandidateEvaluator

    started = time.perf_counter()
    budget_bytes = parse_bytes(budget, name="budget")
    if not 0 <= margin < 1:
        raise ValueError(f"`margin` must be in [0, 1), got {margin}")
    if isinstance(max_estimates, bool) or not isinstance(max_estimates, int) or max_estimates < 1:
        raise ValueError(f"`max_estimates` must be an int >= 1, got {max_estimates!r}")
    if config is not None:
        precision, optimizer, optimizer_kwargs, fixed = _fixed_axes(config, precision, optimizer, optimizer_kwargs)
        if config.sharding is not None:
            if world_size not in (1, config.sharding.world_size):
                raise ValueError(
                    f"`world_size`={world_size} disagrees with `config`'s sharding ({config.sharding.kind} x"
                    f"{config.sharding.world_size}); give one of them"
                )
            world_size = config.sharding.world_size
            shardings = shardings if shardings is not None else [config.sharding.kind]
        precisions = precisions if precisions is not None else fixed.get("precisions")
        checkpointing = checkpointing if checkpointing is not None else fixed.get("checkpointing")
        compressions = compressions if compressions is not None else fixed.get("compressions")
        optimizers = optimizers if optimizers is not None else fixed.get("optimizers")
        micro_batch_sizes = micro_batch_sizes if micro_batch_sizes is not None else fixed.get("micro_batch_sizes")
        loras = loras if loras is not None else fixed.get("loras")
        cross_entropies = cross_entropies if cross_entropies is not None else fixed.get("cross_entropies")
    if cross_entropies is None:  # a candidate where it needs no change to the training step
        from lightning_lowmem.functional.cross_entropy.models import routes_loss

        cross_entropies = [None, "chunked"] if routes_loss(module) else [None]
    sharding_axis = _sharding_axis(world_size, shardings)
    batch_size = _batch_size(batch)
    unknown_optimizer = False
    if optimizer is None:
        from lightning_lowmem.planning._fake_step import configured_optimizer

        found = configured_optimizer(module)
        unknown_optimizer = found is None and callable(getattr(module, "configure_optimizers", None))
        optimizer, configured_kwargs = found if found is not None else ("adamw", {})
        optimizer_kwargs = {**configured_kwargs, **(optimizer_kwargs or {})}
        if unknown_optimizer and optimizers is None:
            optimizers = ["adamw"]  # estimated as AdamW; a plan must not swap an optimizer it cannot name
    stages = _stages(
        batch_size, precision, optimizer, precisions, checkpointing, compressions, optimizers, micro_batch_sizes, loras,
        cross_entropies,
    )  # fmt: skip
    stages = [stage for stage in stages if stage] or [[TrainingConfig(precision=precision, optimizer=optimizer)]]
    if sharding_axis:  # every mix on every sharding; sharded candidates are estimated per rank, in full
        stages = [[c.replace(sharding=s) for c in stage for s in sharding_axis] for stage in stages]
    usable = int(budget_bytes * (1 - margin))
    family = _family(optimizer)
    overheads = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES if include_overheads and device == "cuda" else 0
    limit = usable - overheads  # a model-side run that passes this (without optimizer state) cannot fit

    def kwargs_for(name: str) -> dict[str, Any]:
        if _family(name) != family:
            return {}
        from lightning_lowmem.functional.optimizers.registry import optimizer_arguments

        accepted = set(optimizer_arguments(name))
        return {key: value for key, value in (optimizer_kwargs or {}).items() if key in accepted}

    evaluator = CandidateEvaluator(
        module, batch, loss_fn=loss_fn, device=device, loop=loop, optimizer_kwargs=kwargs_for, attention_kernel=attention_kernel
    )
    evaluator.reserve_optimizers = sorted({c.optimizer.name for stage in stages for c in stage})
    evaluated: dict[TrainingConfig, Candidate] = {}
    tried: list[Candidate] = []

    def fits(report: MemoryReport) -> bool:
        overheads = sum(report.overheads.values()) if include_overheads else 0
        return report.peak_bytes + overheads <= usable

    # progress numbers every configuration predicted once, in order, out of all the search could try (it stops
    # at the first that fits): [1/108], [2/108], ... never repeated or skipped
    plain = TrainingConfig(precision=precision, optimizer=optimizer)
    first = plain.replace(sharding=sharding_axis[0]) if sharding_axis else plain
    searchable = len({first, *(config for stage in stages for config in stage)})
    numbered: dict[TrainingConfig, int] = {}

    def predict(config: TrainingConfig, complete: bool = False) -> Candidate:
        """``complete``: a figure even when it cannot fit (else the model-side run stops at the budget)."""
        known = evaluated.get(config)
        if known is not None and (not complete or known.method != "lower bound"):
            return known
        candidate = known or Candidate(config, expected_slowdown(config, batch_size))
        try:
            if config.sharding is not None:  # the per-axis parts know nothing of sharding: the per-rank estimate
                candidate.report = evaluator.full(config)
            else:
                candidate.report = evaluator.predict(config, None if complete else limit)
            candidate.fits = fits(candidate.report)
        except EstimationError:
            raise
        except (ImportError, RuntimeError, ValueError, NotImplementedError) as err:
            candidate.error = _short_error(err)  # cannot be built on this model: skipped, the search goes on
            candidate.fits = False
        evaluated[config] = candidate
        if config not in numbered:  # a lower bound completed later is the same configuration, not a new one
            numbered[config] = len(numbered) + 1
            _report_progress(candidate, numbered[config], max(searchable, len(numbered)), usable, progress)
        return candidate

    def skip(config: TrainingConfig, err: Exception) -> None:
        """Record a candidate that cannot be built on this model (listed in the plan / the error)."""
        if config not in evaluated:
            evaluated[config] = Candidate(config, expected_slowdown(config, batch_size), fits=False, error=_short_error(err))

    def confirm(candidate: Candidate) -> bool:
        """Re-estimate a fitting prediction in full; the full figure decides."""
        if candidate.method == "full":
            return bool(candidate.fits)
        candidate.per_axis_peak_bytes = candidate.predicted_peak_bytes
        candidate.report = evaluator.full(candidate.config)
        candidate.fits = fits(candidate.report)
        log.info(
            "plan_memory: %s re-estimated in full: %s (per-axis %s)%s",
            candidate.config.describe(), format_bytes(candidate.report.peak_bytes),
            format_bytes(candidate.per_axis_peak_bytes or 0), "" if candidate.fits else ", over the budget",
        )  # fmt: skip
        return candidate.fits

    baseline = predict(first, complete=True)
    chosen: Candidate | None = None
    for stage in stages:
        ranked = sorted(stage, key=lambda c: expected_slowdown(c, batch_size))
        sharded = any(c.sharding is not None and c.sharding.kind != "ddp" for c in stage)
        if not predict(ranked[0]).fits and not sharded and not _model_side_can_fit(stage, evaluator, limit, skip):
            continue  # not even the leanest model side that can be built fits: no candidate of this stage can
        for config in ranked:
            if evaluator.probes + evaluator.full_estimates >= max_estimates:
                break
            candidate = predict(config)
            if candidate not in tried:
                tried.append(candidate)
            if candidate.fits and confirm(candidate):
                chosen = candidate
                break
        if chosen is None:  # the cap was reached: the fastest of what fits
            for candidate in sorted(evaluated.values(), key=lambda c: c.slowdown):
                if candidate.fits and candidate.config in stage and confirm(candidate):
                    chosen = candidate
                    break
        if chosen is not None:
            break
    if chosen is None:
        complete = 0
        for config in sorted(stages[-1], key=_leanness, reverse=True):  # complete figures for the message
            if complete == 2:
                break
            complete += predict(config, complete=True).error is None
        raise _no_fit_error(list(evaluated.values()), budget, usable, margin)
    for candidate in [c for c in evaluated.values() if c not in tried]:
        tried.append(candidate)  # the leanest checks, shown after the ranked ones
    if baseline in tried:
        tried.remove(baseline)
    tried.insert(0, baseline)
    plan = Plan(
        chosen=chosen,
        candidates=tried,
        budget_bytes=budget_bytes,
        usable_bytes=usable,
        device=device,
        baseline=baseline,
        optimizer_kwargs={} if _family(chosen.config.optimizer.name) == family
        else {"lr": DEFAULT_LR[_family(chosen.config.optimizer.name)]},
    )  # fmt: skip
    for reason, labels in plan.skipped.items():
        plan.notes.append(f"skipped {len(labels)} candidate(s) that cannot be built on this model ({reason}).")
    if unknown_optimizer:
        plan.notes.append("configure_optimizers' optimizer is not one the estimator knows: estimated as AdamW, kept.")
    caveat = numerics_caveat(chosen.config)
    if caveat is not None:
        plan.notes.append(caveat)
    plan.notes.append(
        f"{len(evaluated)} candidates predicted from {evaluator.probes} model-side runs and {evaluator.profiles} "
        f"optimizer profiles; {evaluator.full_estimates} full estimate(s)."
    )
    if chosen.per_axis_peak_bytes is not None:
        plan.notes.append(
            f"chosen: full estimate {format_bytes(plan.predicted_peak_bytes)}, per-axis prediction "
            f"{format_bytes(chosen.per_axis_peak_bytes)}."
        )
    plan.seconds = time.perf_counter() - started
    log.info("plan_memory: %s chosen in %.1f s (%s)", chosen.config.describe(), plan.seconds, plan.notes[-1])
    return plan


def _fixed_axes(
    config: TrainingConfig, precision: str, optimizer: str | None, optimizer_kwargs: dict[str, Any] | None
) -> tuple[str, str | None, dict[str, Any] | None, dict[str, list[Any]]]:
    """What ``plan_memory(config=...)`` keeps fixed: each technique ``config`` sets, as a one-value axis."""
    if not isinstance(config, TrainingConfig):
        raise TypeError(f"`config` must be a TrainingConfig, got {type(config).__name__}: {config!r}")
    if config.quantization is not None:
        raise ValueError(
            f"plan_memory plans a training mix; `config` sets quantization ({config.describe()!r}). Estimate a "
            "quantized mix with estimate_memory(config=...)."
        )
    fixed: dict[str, list[Any]] = {}
    if config.precision is not None:
        precision = config.precision.preset
        fixed["precisions"] = [precision]
    if config.optimizer is not None:
        optimizer = config.optimizer.name
        optimizer_kwargs = {**config.optimizer.kwargs, **(optimizer_kwargs or {})}
        fixed["optimizers"] = [optimizer]
    for axis, value in (("checkpointing", config.checkpointing), ("compressions", config.compression),
                        ("micro_batch_sizes", config.microbatch), ("loras", config.lora),
                        ("cross_entropies", config.cross_entropy)):  # fmt: skip
        if value is not None:
            fixed[axis] = [value]
    return precision, optimizer, optimizer_kwargs, fixed


def _sharding_axis(world_size: int, shardings: Iterable[str] | None) -> list[ShardingConfig]:
    """The sharding axis: empty for one process, else each kind at ``world_size`` (validated)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size`={world_size!r} must be an int >= 1: the number of processes (GPUs)")
    if world_size == 1:
        if shardings is not None and list(shardings) not in ([], ["ddp"]):
            raise ValueError(
                f"`shardings`={list(shardings)!r} needs `world_size` > 1: one process has nothing to shard"
            )
        return []
    kinds = list(dict.fromkeys(shardings if shardings is not None else SHARDINGS))
    if not kinds:
        raise ValueError("`shardings` is empty; give at least one of 'ddp', 'zero1', 'fsdp'")
    return [ShardingConfig(kind, world_size) for kind in kinds]


def _model_side_can_fit(
    stage: list[TrainingConfig], evaluator: Any, limit: int, skip: Callable[[TrainingConfig, Exception], None]
) -> bool:
    """Whether the model side (no optimizer state) of one of the stage's four leanest candidates that can be
    built fits ``limit``; if none does, no candidate of the stage can fit, and the stage is skipped without
    predicting them. A candidate that cannot be built on this model (e.g. checkpointing ``"auto"`` where no
    block repeats) says nothing about the others: the next-leanest is checked instead."""
    checked = 0
    for config in sorted(stage, key=_leanness, reverse=True):
        if checked == 4:
            break
        try:
            if evaluator.model_side_fits(config, limit):
                return True
        except EstimationError:
            raise
        except (ImportError, RuntimeError, ValueError, NotImplementedError) as err:
            skip(config, err)  # the evaluator remembers the error: its other candidates fail fast later
            continue
        checked += 1
    return False


def _short_error(err: BaseException) -> str:
    """``"TypeName: first sentence"`` of an error (at most 160 characters), for a skipped candidate."""
    text = str(err).splitlines()[0] if str(err) else ""
    text = text.split(". ")[0].rstrip(".")
    return f"{type(err).__name__}: {text[:160]}"


def _report_progress(candidate: Candidate, index: int, total: int, usable: int, progress: Progress | None) -> None:
    if candidate.report is not None:
        outcome = f"{peak_label(candidate)} ({'fits' if candidate.fits else 'over'} {format_bytes(usable)}, " \
                  f"{candidate.method})"  # fmt: skip
    else:
        outcome = f"not estimated: {candidate.error}"
    log.info("plan_memory [%d/%d] %s: %s", index, total, candidate.config.describe(), outcome)
    if progress is not None:
        progress(candidate, index, total)


def _no_fit_error(evaluated: list[Candidate], budget: Any, usable: int, margin: float) -> ValueError:
    measured = [c for c in evaluated if c.report is not None and c.method != "lower bound"]
    failed: dict[str, int] = {}
    for candidate in evaluated:
        if candidate.error:
            failed[candidate.error] = failed.get(candidate.error, 0) + 1
    skipped = "; ".join(f"{count} x {error}" for error, count in failed.items())
    if not measured:
        return ValueError(f"no configuration could be estimated for `budget`={budget!r}: skipped {skipped}")
    smallest = min(measured, key=lambda c: c.report.peak_bytes)  # type: ignore[union-attr]
    return ValueError(
        f"no configuration fits `budget`={budget!r} ({format_bytes(usable)} usable after a {margin:.0%} margin): "
        f"the smallest predicted peak is {format_bytes(smallest.predicted_peak_bytes or 0)} with "
        f"[{smallest.config.describe()}]. Raise the budget, lower the batch size, or shrink the model."
        + (f" Skipped (cannot be built on this model): {skipped}." if failed else "")
    )
