"""The planner's search, step by step: :class:`PlanSearch` (what :func:`~lightning_lowmem.planning.plan.plan_memory`
runs).

1. :meth:`PlanSearch.stages`: the candidates, from the axes of :data:`~lightning_lowmem.planning.axes.AXES` (whole
   batches first, micro-batches as a last stage);
2. :meth:`PlanSearch.ranked`: a stage in order of expected slowdown (:func:`expected_slowdown`);
3. :meth:`PlanSearch.predict`: a candidate's peak from per-axis measurements (one model-side run per model-side
   setting, one optimizer profile per optimizer; ``planning/_components.py``), the model-side run stopped once it
   passes the budget, or not run at full depth when two shallow copies' secant already passes it
   (``planning/_depth.py``); :meth:`PlanSearch.predict_in_order` adds the dominance shortcut (a candidate without the
   chunked loss is predicted only if the same candidate with it fits);
4. :meth:`PlanSearch.confirm`: the first fitting prediction re-estimated in full (:func:`estimate_memory`);
5. :meth:`PlanSearch.skip` / :attr:`PlanSearch.evaluated`: candidates that cannot be built on the model, listed in
   the plan.

:meth:`PlanSearch.run` strings them together and returns the :class:`Plan`.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Iterable

import torch
from torch import nn

from lightning_lowmem.functional.config.techniques import OptimizerConfig
from lightning_lowmem.memory.report import MemoryReport
from lightning_lowmem.memory.units import format_bytes, parse_bytes
from lightning_lowmem.planning._fake_step import accumulation_steps, tensor_leaves
from lightning_lowmem.planning.axes import AXES, AxisContext, axis, carried, fixed_axes, leanness, sharding_axis
from lightning_lowmem.planning.estimate import (
    EstimationError,
    TrainingConfig,
)
from lightning_lowmem.planning.gpus import card_overheads, resolve_card
from lightning_lowmem.planning.optimizer_argument import configured_optimizer_config, optimizer_config
from lightning_lowmem.planning.plan_report import Candidate, Plan, no_fit_error, peak_label, short_error
from lightning_lowmem.planning.priors import DEFAULT_LR, expected_slowdown, numerics_caveat

__all__ = ["PlanSearch", "Progress"]

log = logging.getLogger("lightning_lowmem.planning.plan")  # the planner's one logger (plan_memory's module)

Progress = Callable[[Candidate, int, int], None]
"""``progress(candidate, index, total)``: called after each candidate is predicted (``index`` counts from
1; ``total`` is the size of the space being searched, an upper bound: the search stops at the first fit)."""

NEAR_BUDGET = 0.98
"""``full_check="near-budget"``: a per-axis prediction above this share of the usable memory is re-estimated in full
before it is chosen (the two agreed to the byte, or within 512 B, wherever the benchmarks compare them)."""

_BUILD_ERRORS = (ImportError, RuntimeError, ValueError, NotImplementedError)
"""What a candidate that cannot be built on this model raises (skipped; an :class:`EstimationError` is not)."""


class PlanSearch:
    """One search of :func:`~lightning_lowmem.planning.plan.plan_memory` (its arguments, validated here; see there).

    ``axes`` maps a ``plan_memory`` axis argument (``"precisions"``, ``"checkpointing"``, ... see
    :data:`~lightning_lowmem.planning.axes.AXES`) to its values, ``None`` or absent for the defaults.

    Example::

        >>> from lightning_lowmem.demo import CharLM
        >>> model = CharLM(n_layer=2, n_embd=64, block_size=32)
        >>> search = PlanSearch(model, (torch.zeros(8, 32, dtype=torch.long),) * 2, "1GiB", device="cpu")
        >>> [config.describe() for config in search.ranked(search.stages[0])][:2]
        ['32-true + adamw', 'bf16-mixed + adamw']
        >>> search.run().config.describe()
        '32-true + adamw'
    """

    def __init__(
        self,
        module: nn.Module,
        batch: Any,
        budget: int | str | None,
        *,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        optimizer: str | OptimizerConfig | None = None,
        precision: str = "32-true",
        device: str = "cuda",
        margin: float = 0.1,
        axes: dict[str, Iterable[Any] | None] | None = None,
        optimizer_kwargs: dict[str, Any] | None = None,
        config: TrainingConfig | None = None,
        world_size: int = 1,
        max_estimates: int = 60,
        include_overheads: bool = False,
        loop: str = "auto",
        progress: Progress | None = None,
        attention_kernel: str = "auto",
        full_check: str = "always",
        accumulate_grad_batches: int = 1,
        gpu: str | None = None,
    ) -> None:
        from lightning_lowmem.planning._evaluate import CandidateEvaluator

        if full_check not in ("always", "near-budget"):
            raise ValueError(f"`full_check`={full_check!r} is unknown; choose 'always' or 'near-budget'")
        self.full_check = full_check
        self.started = time.perf_counter()
        self.card = resolve_card(gpu, device)
        self.accumulate = accumulation_steps(accumulate_grad_batches)
        if budget is None:
            if self.card is None:
                raise ValueError("`budget` is missing: give the bytes the step may use (e.g. '8GiB') or a `gpu`")
            budget, include_overheads = self.card.capacity_bytes, True
        self.budget = budget
        self.budget_bytes = parse_bytes(budget, name="budget")
        if not 0 <= margin < 1:
            raise ValueError(f"`margin` must be in [0, 1), got {margin}")
        if isinstance(max_estimates, bool) or not isinstance(max_estimates, int) or max_estimates < 1:
            raise ValueError(f"`max_estimates` must be an int >= 1, got {max_estimates!r}")
        unknown = set(axes or {}) - {row.argument for row in AXES}
        if unknown:
            raise ValueError(f"unknown search axes {sorted(unknown)}; axes: {', '.join(row.argument for row in AXES)}")
        given = {row.argument: (axes or {}).get(row.argument) for row in AXES}
        self.carried = carried(config) if config is not None else {}  # in every candidate: no axis searches them
        if config is not None:
            precision, fixed = fixed_axes(config, precision)
            if config.optimizer is not None:  # it replaces `optimizer`
                optimizer = config.optimizer
                if optimizer_kwargs:  # more hyperparameters for it: the old shorthand
                    merged = {**config.optimizer.kwargs, **optimizer_kwargs}
                    optimizer = optimizer_config(config.optimizer.name, merged, stacklevel=4)
                optimizer_kwargs = None
            if config.sharding is not None:
                if world_size not in (1, config.sharding.world_size):
                    raise ValueError(
                        f"`world_size`={world_size} disagrees with `config`'s sharding ({config.sharding.kind} x"
                        f"{config.sharding.world_size}); give one of them"
                    )
                world_size = config.sharding.world_size
            given = {
                argument: values if values is not None else fixed.get(argument) for argument, values in given.items()
            }
        self.sharding_axis = sharding_axis(world_size, given["shardings"])
        self.batch_size = _batch_size(batch)
        self.unknown_optimizer = False
        wanted = optimizer_config(optimizer, optimizer_kwargs, stacklevel=4)  # plan_memory -> here -> optimizer_config
        if wanted is None:  # configure_optimizers' own; optimizer_kwargs replace its arguments (those it takes)
            wanted, found = configured_optimizer_config(module, optimizer_kwargs, accepted_only=True)
            self.unknown_optimizer = not found and callable(getattr(module, "configure_optimizers", None))
            if self.unknown_optimizer and given["optimizers"] is None:
                given["optimizers"] = ["adamw"]  # estimated as AdamW; a plan must not swap an optimizer it cannot name
        self.precision = precision
        self.optimizer: OptimizerConfig = wanted
        """The optimizer asked for, with its hyperparameters (those of its family's candidates, :meth:`kwargs_for`)."""
        self.context = AxisContext(precision, wanted.name, self.batch_size, module, world_size)
        self.axis_values = {argument: self._values(argument, values) for argument, values in given.items()}
        self.micro_batches_given = given["micro_batch_sizes"] is not None
        self.stages = self._build_stages()
        self.device, self.margin, self.max_estimates = device, margin, max_estimates
        self.include_overheads, self.progress = include_overheads, progress
        self.usable = int(self.budget_bytes * (1 - margin))
        self.family = _family(wanted.name)
        overheads = card_overheads(self.card) if include_overheads and device == "cuda" else 0
        self.limit = self.usable - overheads  # a model-side run that passes this (without optimizer state) cannot fit
        self.evaluator = CandidateEvaluator(
            module,
            batch,
            loss_fn=loss_fn,
            device=device,
            loop=loop,
            optimizer_kwargs=self.kwargs_for,
            attention_kernel=attention_kernel,
            accumulate_grad_batches=self.accumulate,
            gpu=self.card,
        )
        self.evaluator.reserve_optimizers = sorted({c.optimizer.name for stage in self.stages for c in stage})
        self.evaluated: dict[TrainingConfig, Candidate] = {}
        """Every candidate predicted (or skipped), by configuration."""
        self.tried: list[Candidate] = []
        plain = TrainingConfig(precision=precision, optimizer=wanted.name)
        self.first = plain.replace(sharding=self.sharding_axis[0]) if self.sharding_axis else plain
        # progress numbers every configuration predicted once, in order, out of all the search could try (it stops
        # at the first that fits): [1/108], [2/108], ... never repeated or skipped
        self.searchable = {self.first, *(config for stage in self.stages for config in stage)}
        self.numbered: dict[TrainingConfig, int] = {}

    # ------------------------------------------------------------------ 1. the candidates
    def _values(self, argument: str, values: Iterable[Any] | None) -> list[Any]:
        if argument == "shardings":
            return list(self.sharding_axis) or [None]
        row = axis(argument)
        if values is None:
            return row.default_values(self.context)
        values = list(values)
        if argument == "precisions" and not values:
            return row.default_values(self.context)  # an empty list: the defaults, as before
        if argument == "optimizers" and not values:
            return row.default_values(self.context)
        return values

    def space(self, overrides: dict[str, list[Any]] | None = None) -> list[TrainingConfig]:
        """Every combination of the axes' values (``overrides`` replaces some axes), in :data:`AXES` order, less those
        that cannot train (an optimizer-in-backward steps on every backward: no micro-batches, no accumulation)."""
        values = {**self.axis_values, **(overrides or {})}
        configs = []
        for combination in itertools.product(*(values[row.argument] for row in AXES)):
            settings = {row.field: value for row, value in zip(AXES, combination, strict=True)}
            if settings["lora"] is not None and not settings["lora"]:
                settings["lora"] = None  # {} means no LoRA
            config = TrainingConfig(**settings, **self.carried)
            steps_in_backward = config.microbatch is not None or self.accumulate > 1
            if not (steps_in_backward and config.optimizer.in_backward):
                configs.append(config)
        return configs

    def _build_stages(self) -> list[list[TrainingConfig]]:
        """The search space in stages: whole batches first; an axis's fallback values (micro-batches) only when no
        candidate of the first stage fits (unless the axis's values are given: then one stage)."""
        if self.micro_batches_given:
            stages = [self.space()]
        else:
            fallback = {row.argument: row.fallback_values(self.context) for row in AXES if row.fallback_values}
            stages = [self.space(), self.space(fallback)]
        plain = TrainingConfig(precision=self.precision, optimizer=self.optimizer.name)
        return [stage for stage in stages if stage] or [
            [plain.replace(sharding=s) for s in self.sharding_axis] or [plain]
        ]

    # ------------------------------------------------------------------ 2. the order
    def ranked(self, stage: list[TrainingConfig]) -> list[TrainingConfig]:
        """``stage`` in order of expected slowdown (ties keep the order of the axes)."""
        return sorted(stage, key=lambda config: expected_slowdown(config, self.batch_size))

    # ------------------------------------------------------------------ 3. predictions
    def kwargs_for(self, name: str) -> dict[str, Any]:
        """The hyperparameters of the optimizer asked for that optimizer ``name`` accepts (none for another family)."""
        if _family(name) != self.family:
            return {}
        from lightning_lowmem.functional.optimizers.catalog import optimizer_arguments

        accepted = set(optimizer_arguments(name))
        return {key: value for key, value in self.optimizer.kwargs.items() if key in accepted}

    def fits(self, report: MemoryReport) -> bool:
        overheads = sum(report.overheads.values()) if self.include_overheads else 0
        return report.peak_bytes + overheads <= self.usable

    def predict(self, config: TrainingConfig, complete: bool = False) -> Candidate:
        """``config``'s per-axis prediction (cached); ``complete``: a figure even when it cannot fit (else the
        model-side run stops at the budget and the figure is a lower bound)."""
        known = self.evaluated.get(config)
        if known is not None and (not complete or known.method != "lower bound"):
            return known
        candidate = known or Candidate(config, expected_slowdown(config, self.batch_size))
        candidate.error = None
        try:
            if config.sharding is not None:  # the per-axis parts know nothing of sharding: the per-rank estimate
                candidate.report = self.evaluator.full(config)
            else:
                candidate.report = self.evaluator.predict(config, None if complete else self.limit)
            candidate.fits = self.fits(candidate.report)
        except EstimationError:
            raise
        except _BUILD_ERRORS as err:
            candidate.error = short_error(err)  # cannot be built on this model: skipped, the search goes on
            candidate.fits = False
        self._record(candidate)
        return candidate

    def predict_in_order(self, config: TrainingConfig) -> Candidate:
        """:meth:`predict`, with the dominance shortcut of the axes that have a value that never adds memory (the
        chunked loss): a candidate without it is predicted only if the same candidate with it is not proven over the
        budget by its forward (:meth:`CandidateEvaluator.model_side_over`); otherwise it is listed with that
        candidate's lower bound as its own, and no run is made for it."""
        if config in self.evaluated or config.sharding is not None:
            return self.predict(config)
        for row in AXES:
            if row.never_adds_memory is None or getattr(config, row.field) is not None:
                continue
            leaner = config.replace(**{row.field: row.never_adds_memory})
            if leaner not in self.searchable:
                continue
            try:  # a run of the leaner twin's forward at most: over the budget there, this candidate is too
                if self.evaluator.model_side_over(leaner, self.limit):
                    return self._dominated(config, self.predict(leaner))
            except EstimationError:
                raise
            except _BUILD_ERRORS as err:
                self.skip(leaner, err)
        return self.predict(config)

    def _dominated(self, config: TrainingConfig, lean: Candidate) -> Candidate:
        assert lean.report is not None
        report = MemoryReport(
            peak_bytes=lean.report.peak_bytes,
            breakdown=dict(lean.report.breakdown),
            device=lean.report.device,
            overheads=dict(lean.report.overheads),
            source="estimated",
            meta={
                "config": config.to_dict(),
                "label": config.describe(),
                "method": "lower bound",
                "dominated_by": lean.config.describe(),
            },
        )
        candidate = Candidate(config, expected_slowdown(config, self.batch_size), report=report, fits=False)
        self._record(candidate)
        return candidate

    def _record(self, candidate: Candidate) -> None:
        config = candidate.config
        self.evaluated[config] = candidate
        if config not in self.numbered:  # a lower bound completed later is the same configuration, not a new one
            self.numbered[config] = len(self.numbered) + 1
            total = max(len(self.searchable), len(self.numbered))
            _report_progress(candidate, self.numbered[config], total, self.usable, self.progress)

    # ------------------------------------------------------------------ 4. the full estimate decides
    def confirm(self, candidate: Candidate) -> bool:
        """Re-estimate a fitting prediction in full; the full figure decides."""
        if candidate.method == "full":
            return bool(candidate.fits)
        peak = candidate.predicted_peak_bytes or 0
        if self.full_check == "near-budget" and candidate.method == "per-axis" and peak <= NEAR_BUDGET * self.usable:
            return True  # far enough below the budget that the full estimate (equal to it where checked) cannot differ
        candidate.per_axis_peak_bytes = candidate.predicted_peak_bytes
        candidate.report = self.evaluator.full(candidate.config)
        candidate.fits = self.fits(candidate.report)
        log.info(
            "plan_memory: %s re-estimated in full: %s (per-axis %s)%s",
            candidate.config.describe(),
            format_bytes(candidate.report.peak_bytes),
            format_bytes(candidate.per_axis_peak_bytes or 0),
            "" if candidate.fits else ", over the budget",
        )
        return candidate.fits

    # ------------------------------------------------------------------ 5. skipped candidates
    def skip(self, config: TrainingConfig, err: Exception) -> None:
        """Record a candidate that cannot be built on this model (listed in the plan / the error)."""
        if config not in self.evaluated:
            self.evaluated[config] = Candidate(
                config, expected_slowdown(config, self.batch_size), fits=False, error=short_error(err)
            )

    def model_side_can_fit(self, stage: list[TrainingConfig]) -> bool:
        """Whether the model side (no optimizer state) of one of the stage's four leanest candidates that can be
        built may fit: its forward does not pass the budget; if each passes it, no candidate of the stage can fit, and
        the stage is skipped without predicting them. A candidate that cannot be built on this model (e.g. checkpointing ``"auto"`` where no block repeats)
        says nothing about the others: the next-leanest is checked instead."""
        checked = 0
        for config in sorted(stage, key=leanness, reverse=True):
            if checked == 4:
                break
            try:
                if not self.evaluator.model_side_over(config, self.limit):
                    return True  # not proven over the budget by its forward: the stage is searched
            except EstimationError:
                raise
            except _BUILD_ERRORS as err:
                self.skip(config, err)  # the evaluator remembers the error: its other candidates fail fast later
                continue
            checked += 1
        return False

    # ------------------------------------------------------------------ the whole search
    def search_stage(self, stage: list[TrainingConfig]) -> Candidate | None:
        """The fastest candidate of ``stage`` that fits (its full estimate fits), or ``None``."""
        ranked = self.ranked(stage)
        sharded = any(c.sharding is not None and c.sharding.kind != "ddp" for c in stage)
        if not self.predict(ranked[0]).fits and not sharded and not self.model_side_can_fit(stage):
            return None  # not even the leanest model side that can be built fits: no candidate of this stage can
        for config in ranked:
            if self.evaluator.probes + self.evaluator.full_estimates >= self.max_estimates:
                break
            candidate = self.predict_in_order(config)
            if candidate not in self.tried:
                self.tried.append(candidate)
            if candidate.fits and self.confirm(candidate):
                return candidate
        for candidate in sorted(self.evaluated.values(), key=lambda c: c.slowdown):  # the cap: the fastest that fits
            if candidate.fits and candidate.config in stage and self.confirm(candidate):
                return candidate
        return None

    def run(self) -> Plan:
        """Search the stages in order; the :class:`Plan` of the first fitting candidate.

        Raises:
            ValueError: no candidate fits (the smallest predicted peak is named).
        """
        baseline = self.predict(self.first, complete=True)
        chosen = None
        for stage in self.stages:
            chosen = self.search_stage(stage)
            if chosen is not None:
                break
        if chosen is None:
            complete = 0
            for config in sorted(self.stages[-1], key=leanness, reverse=True):  # complete figures for the message
                if complete == 2:
                    break
                complete += self.predict(config, complete=True).error is None
            raise no_fit_error(list(self.evaluated.values()), self.budget, self.usable, self.margin)
        return self._plan(chosen, baseline)

    def _plan(self, chosen: Candidate, baseline: Candidate) -> Plan:
        tried = list(self.tried)
        for candidate in [c for c in self.evaluated.values() if c not in tried]:
            tried.append(candidate)  # the leanest checks, shown after the ranked ones
        if baseline in tried:
            tried.remove(baseline)
        tried.insert(0, baseline)
        name = chosen.config.optimizer.name
        new_family = {"lr": DEFAULT_LR[_family(name)]} if _family(name) != self.family else {}
        plan = Plan(
            chosen=chosen,
            candidates=tried,
            budget_bytes=self.budget_bytes,
            usable_bytes=self.usable,
            device=self.device,
            baseline=baseline,
            optimizer_kwargs=new_family,
            optimizer=OptimizerConfig(name, {**new_family, **self.kwargs_for(name), **chosen.config.optimizer.kwargs}),
        )
        for reason, labels in plan.skipped.items():
            plan.notes.append(f"skipped {len(labels)} candidate(s) that cannot be built on this model ({reason}).")
        if self.unknown_optimizer:
            plan.notes.append(
                "configure_optimizers' optimizer is not one the estimator knows: estimated as AdamW, kept."
            )
        caveat = numerics_caveat(chosen.config)
        if caveat is not None:
            plan.notes.append(caveat)
        evaluator = self.evaluator
        dominated = sum(1 for c in self.evaluated.values() if c.report is not None and "dominated_by" in c.report.meta)
        plan.notes.append(
            f"{len(self.evaluated)} candidates predicted from {evaluator.probes} model-side runs and {evaluator.profiles} "
            f"optimizer profiles; {evaluator.full_estimates} full estimate(s)."
            + (f" {dominated} ruled out by a leaner twin (the chunked loss never adds memory)." if dominated else "")
            + (
                f" {evaluator.depth_bounds} runs of shallow copies (2 to 4 blocks) bounded model sides from below or"
                " stood in for full-depth runs."
                if evaluator.depth_bounds
                else ""
            )
        )
        if chosen.per_axis_peak_bytes is not None:
            plan.notes.append(
                f"chosen: full estimate {format_bytes(plan.predicted_peak_bytes)}, per-axis prediction "
                f"{format_bytes(chosen.per_axis_peak_bytes)}."
            )
        plan.seconds = time.perf_counter() - self.started
        log.info("plan_memory: %s chosen in %.1f s (%s)", chosen.config.describe(), plan.seconds, plan.notes[-1])
        return plan


# ----------------------------------------------------------------------------- helpers
def _batch_size(batch: Any) -> int | None:
    sizes = {leaf.shape[0] for leaf in tensor_leaves(batch) if leaf.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _family(name: str) -> str:
    from lightning_lowmem.functional.optimizers.catalog import state_layout

    return state_layout(name)[0]


def _report_progress(candidate: Candidate, index: int, total: int, usable: int, progress: Progress | None) -> None:
    if candidate.report is not None:
        outcome = f"{peak_label(candidate)} ({'fits' if candidate.fits else 'over'} {format_bytes(usable)}, {candidate.method})"
    else:
        outcome = f"not estimated: {candidate.error}"
    log.info("plan_memory [%d/%d] %s: %s", index, total, candidate.config.describe(), outcome)
    if progress is not None:
        progress(candidate, index, total)
