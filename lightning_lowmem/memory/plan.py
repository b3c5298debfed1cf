"""`plan_memory`: the cheapest technique mix whose estimated peak fits a memory budget."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from lightning_lowmem.memory._fake_step import tensor_leaves as _tensor_leaves
from lightning_lowmem.memory.estimate import EstimationError, TrainingConfig, estimate_memory
from lightning_lowmem.memory.report import MemoryReport
from lightning_lowmem.memory.units import format_bytes, parse_bytes

__all__ = ["SLOWDOWN", "Candidate", "Plan", "expected_slowdown", "plan_memory"]

SLOWDOWN: dict[str, float] = {
    "precision:32-true": 1.0,
    "precision:bf16-mixed": 1.0,
    "precision:16-mixed": 1.0,
    "precision:bf16-true": 1.0,
    "precision:16-true": 1.0,
    "checkpointing": 1.33,  # one extra forward of the wrapped blocks
    "compression:bf16": 1.05,
    "compression:int8": 1.15,
    "compression:cpu": 1.25,
    "optimizer:adamw": 1.0,
    "optimizer:adam": 1.0,
    "optimizer:sgd": 1.0,
    "optimizer:adafactor": 1.03,
    "optimizer:adamw8bit": 1.05,
    "optimizer:adamw4bit": 1.08,
    "micro_batch_per_split": 0.08,  # each extra micro-batch costs ~8% (smaller kernels, more launches)
    "lora": 0.9,  # no weight gradients for the frozen base
    "qlora": 1.1,  # dequantising the frozen base on every forward
}
"""Prior step-time factors (relative to plain fp32 on a GPU) used to rank candidates. They order the
search; they are not promises. Mixed / true half precision are ranked 1.0 although they are usually
faster on GPUs, because their numerics differ: the planner prefers them only when they save memory."""

_PRECISION_RANK = {"32-true": 0, "bf16-mixed": 1, "16-mixed": 1, "bf16-true": 2, "16-true": 2}


def expected_slowdown(config: TrainingConfig, batch_size: int | None = None) -> float:
    """The prior step-time factor of ``config`` (see :data:`SLOWDOWN`)."""
    factor = SLOWDOWN.get(f"precision:{config.precision}", 1.0)
    # precision changes numerics: a tiny tie-breaker so full precision wins when both fit
    factor *= 1.0 + 0.001 * _PRECISION_RANK.get(config.precision, 0)
    if config.activation_checkpointing is not None:
        factor *= SLOWDOWN["checkpointing"]
    if config.activation_compression:
        factor *= SLOWDOWN[f"compression:{config.activation_compression}"]
    factor *= SLOWDOWN.get(f"optimizer:{config.optimizer}", 1.05)
    if config.micro_batch_size and batch_size:
        splits = -(-batch_size // config.micro_batch_size)
        factor *= 1.0 + SLOWDOWN["micro_batch_per_split"] * (splits - 1)
    if config.lora:
        factor *= SLOWDOWN["qlora" if dict(config.lora).get("quantize_base") else "lora"]
    return factor


@dataclass
class Candidate:
    """One evaluated technique mix: its config, prior slowdown and estimate (``None`` if skipped)."""

    config: TrainingConfig
    slowdown: float
    report: MemoryReport | None = None
    fits: bool | None = None
    error: str | None = None

    @property
    def predicted_peak_bytes(self) -> int | None:
        return self.report.peak_bytes if self.report is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "label": self.config.describe(),
            "slowdown": round(self.slowdown, 3),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "fits": self.fits,
            "error": self.error,
        }


@dataclass
class Plan:
    """The chosen configuration and every candidate looked at.

    Attributes:
        chosen: the fitting candidate with the lowest expected slowdown.
        candidates: all evaluated candidates, in the order they were tried.
        budget_bytes: the budget asked for.
        usable_bytes: the budget less the safety margin (and device overheads for CUDA).
        baseline: the configuration as the user asked for it (precision + optimizer, no technique),
            always estimated, so a plan shows what it saves.
    """

    chosen: Candidate
    candidates: list[Candidate]
    budget_bytes: int
    usable_bytes: int
    device: str = "cuda"
    baseline: Candidate | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def config(self) -> TrainingConfig:
        return self.chosen.config

    @property
    def predicted_peak_bytes(self) -> int:
        assert self.chosen.report is not None
        return self.chosen.report.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen.to_dict(),
            "budget_bytes": self.budget_bytes,
            "usable_bytes": self.usable_bytes,
            "device": self.device,
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "candidates": [c.to_dict() for c in self.candidates],
            "notes": self.notes,
        }

    def to_table(self) -> Any:
        """A Rich table: config -> predicted peak -> fits?, the chosen row marked."""
        from rich.table import Table

        table = Table(
            title=f"Memory plan: budget {format_bytes(self.budget_bytes)} "
            f"(usable {format_bytes(self.usable_bytes)} on {self.device})"
        )
        table.add_column("configuration")
        table.add_column("predicted peak", justify="right")
        table.add_column("slowdown (prior)", justify="right")
        table.add_column("fits?", justify="center")
        for candidate in self.candidates:
            chosen = candidate is self.chosen
            if candidate is self.baseline and not chosen:
                candidate_label = candidate.config.describe() + " (as configured)"
            else:
                candidate_label = candidate.config.describe()
            peak = candidate.predicted_peak_bytes
            fits = "-" if candidate.fits is None else ("yes" if candidate.fits else "no")
            table.add_row(
                ("[bold green]> " if chosen else "  ") + candidate_label + ("[/]" if chosen else ""),
                format_bytes(peak) if peak is not None else (candidate.error or "-"),
                f"{candidate.slowdown:.2f}x",
                fits,
            )
        return table


def _batch_size(batch: Any) -> int | None:
    sizes = {leaf.shape[0] for leaf in _tensor_leaves(batch) if leaf.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _space(
    batch_size: int | None,
    precision: str,
    optimizer: str,
    precisions: Iterable[str] | None,
    checkpointing: Iterable[Any] | None,
    compressions: Iterable[str | None] | None,
    optimizers: Iterable[str] | None,
    micro_batch_sizes: Iterable[int | None] | None,
    loras: Iterable[dict[str, Any] | None] | None,
) -> list[TrainingConfig]:
    from lightning_lowmem.functional.optimizers import available_optimizers

    names = set(available_optimizers())
    precisions = list(precisions or dict.fromkeys([precision, "bf16-mixed", "bf16-true"]))
    checkpointing = list(checkpointing if checkpointing is not None else [None, "auto"])
    compressions = list(compressions if compressions is not None else [None, "bf16", "int8"])
    optimizers = list(optimizers or [o for o in dict.fromkeys([optimizer, "adamw8bit", "adafactor"]) if o in names])
    if micro_batch_sizes is None:
        micro_batch_sizes = [None]
        size = batch_size // 2 if batch_size else 0
        while size >= 1:
            micro_batch_sizes.append(size)
            size //= 2
    loras = list(loras if loras is not None else [None])
    configs = [
        TrainingConfig(
            precision=p,
            activation_checkpointing=c,
            activation_compression=z,
            optimizer=o,
            micro_batch_size=m,
            lora=tuple(sorted(lo.items())) if lo else None,
        )
        for p, c, z, o, m, lo in itertools.product(
            precisions, checkpointing, compressions, optimizers, micro_batch_sizes, loras
        )
    ]
    return configs


def plan_memory(
    module: nn.Module,
    batch: Any,
    budget: int | str,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    optimizer: str = "adamw",
    precision: str = "32-true",
    device: str = "cuda",
    margin: float = 0.1,
    precisions: Iterable[str] | None = None,
    checkpointing: Iterable[Any] | None = None,
    compressions: Iterable[str | None] | None = None,
    optimizers: Iterable[str] | None = None,
    micro_batch_sizes: Iterable[int | None] | None = None,
    loras: Iterable[dict[str, Any] | None] | None = None,
    max_estimates: int = 40,
    include_overheads: bool = False,
) -> Plan:
    """Find the technique mix with the lowest expected slowdown whose estimated peak fits ``budget``.

    Every combination of the search axes is ranked by :func:`expected_slowdown`; candidates are then
    estimated (:func:`estimate_memory`, no allocation) in that order until one fits. The most
    memory-lean candidate is estimated first, so an impossible budget fails fast.

    Args:
        module: the model (it is not modified).
        batch: one batch (tensors may be on ``meta``).
        budget: bytes, or a string like ``"8GiB"`` / ``"512MB"``.
        loss_fn: see :func:`estimate_memory`.
        optimizer: the optimizer the user wants; the plain candidate uses it. Default: ``"adamw"``.
        precision: the precision the user wants. Default: ``"32-true"``.
        device: ``"cuda"`` or ``"cpu"`` (see :func:`estimate_memory`). Default: ``"cuda"``.
        margin: share of the budget kept free for what the estimate does not see (fragmentation,
            library workspaces). Default: 0.1.
        precisions, checkpointing, compressions, optimizers, micro_batch_sizes, loras: search axes.
            Defaults: {precision, bf16-mixed, bf16-true}; {None, "auto"}; {None, bf16, int8};
            {optimizer, adamw8bit, adafactor}; {None, B/2, B/4, ..., 1}; {None}.
        max_estimates: stop after this many estimates. Default: 40.
        include_overheads: also subtract the CUDA context / workspace from the budget (set when the
            budget is the card's total memory rather than what torch may allocate). Default: ``False``.

    Returns:
        A :class:`Plan`.

    Raises:
        ValueError: the budget does not parse, or no candidate fits (the message names the smallest
            predicted peak and the configuration that reached it).

    Example::

        >>> from lightning_lowmem.demo import CharLM
        >>> model = CharLM(n_layer=2, n_embd=64, block_size=32)
        >>> batch = (torch.zeros(8, 32, dtype=torch.long),) * 2
        >>> plan = plan_memory(model, batch, "1GiB", device="cpu")
        >>> plan.config.describe()
        '32-true + adamw'
    """
    budget_bytes = parse_bytes(budget, name="budget")
    if not 0 <= margin < 1:
        raise ValueError(f"`margin` must be in [0, 1), got {margin}")
    batch_size = _batch_size(batch)
    configs = _space(
        batch_size, precision, optimizer, precisions, checkpointing, compressions, optimizers, micro_batch_sizes, loras
    )
    ranked = sorted(configs, key=lambda c: expected_slowdown(c, batch_size))
    usable = int(budget_bytes * (1 - margin))
    candidates: list[Candidate] = []

    def evaluate(config: TrainingConfig) -> Candidate:
        candidate = Candidate(config, expected_slowdown(config, batch_size))
        try:
            candidate.report = estimate_memory(module, batch, loss_fn=loss_fn, device=device, config=config)
        except EstimationError:
            raise
        except (ImportError, RuntimeError, ValueError, NotImplementedError) as err:
            candidate.error = f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
            candidate.fits = False
            return candidate
        overheads = sum(candidate.report.overheads.values()) if include_overheads else 0
        candidate.fits = candidate.report.peak_bytes + overheads <= usable
        return candidate

    def no_fit_error() -> ValueError:
        measured = [c for c in evaluated.values() if c.report is not None]
        failed = sorted({c.error for c in evaluated.values() if c.error})
        if not measured:
            return ValueError(f"no configuration could be estimated for `budget`={budget!r}: {failed}")
        smallest = min(measured, key=lambda c: c.report.peak_bytes)  # type: ignore[union-attr]
        return ValueError(
            f"no configuration fits `budget`={budget!r} ({format_bytes(usable)} usable after a {margin:.0%} margin): "
            f"the smallest predicted peak is {format_bytes(smallest.predicted_peak_bytes or 0)} with "
            f"[{smallest.config.describe()}]. Raise the budget, lower the batch size, or shrink the model."
            + (f" Skipped (could not estimate): {failed}" if failed else "")
        )

    evaluated: dict[TrainingConfig, Candidate] = {}
    baseline = evaluate(TrainingConfig(precision=precision, optimizer=optimizer))  # as the user configured it
    evaluated[baseline.config] = baseline
    leanest = evaluated.get(_leanest(configs)) or evaluate(_leanest(configs))
    evaluated[leanest.config] = leanest
    if leanest.report is not None and not leanest.fits:
        # the leanest guess should be the smallest; check the next-leanest few before giving up
        for config in sorted(configs, key=_leanness, reverse=True)[1:4]:
            evaluated[config] = evaluate(config)
        if not any(c.fits for c in evaluated.values()):
            raise no_fit_error()
    chosen: Candidate | None = None
    for config in ranked:
        if len(candidates) >= max_estimates:
            break
        candidate = evaluated.get(config) or evaluate(config)
        evaluated[config] = candidate
        candidates.append(candidate)
        if candidate.fits:
            chosen = candidate
            break
    if chosen is None:
        fitted = [c for c in evaluated.values() if c.fits]
        if not fitted:
            raise no_fit_error()
        chosen = min(fitted, key=lambda c: c.slowdown)
        candidates.append(chosen)
    if leanest not in candidates:
        candidates.append(leanest)
    if baseline not in candidates:
        candidates.insert(0, baseline)
    return Plan(
        chosen=chosen, candidates=candidates, budget_bytes=budget_bytes, usable_bytes=usable, device=device, baseline=baseline
    )


def _leanness(config: TrainingConfig) -> tuple:
    """Sort key: larger = expected to use less memory (every technique at its strongest setting)."""
    return (
        config.lora is not None and bool(dict(config.lora).get("quantize_base")),
        config.lora is not None,
        _PRECISION_RANK.get(config.precision, 0),
        config.activation_checkpointing is not None,
        {"int8": 3, "cpu": 2, "bf16": 1}.get(config.activation_compression or "", 0),
        {"adamw4bit": 4, "adamw8bit": 3, "adafactor": 2, "sgd": 1}.get(config.optimizer, 0),
        -(config.micro_batch_size or 10**9),
    )


def _leanest(configs: list[TrainingConfig]) -> TrainingConfig:
    """The config expected to use the least memory."""
    return max(configs, key=_leanness)
