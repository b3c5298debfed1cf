"""What a plan says: :class:`Candidate` (one technique mix and its predicted peak) and :class:`Plan` (the
chosen one, everything tried, and a Rich table of it). Built by :func:`~lightning_lowmem.planning.plan.plan_memory`."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from lightning_lowmem.functional.config import OptimizerConfig
from lightning_lowmem.planning.estimate import TrainingConfig
from lightning_lowmem.memory.report import MemoryReport
from lightning_lowmem.memory.units import format_bytes

__all__ = ["Candidate", "Plan", "no_fit_error", "peak_label", "rich_progress", "short_error"]


@dataclass
class Candidate:
    """One evaluated technique mix: its config, prior slowdown and predicted peak.

    Attributes:
        config: the technique mix.
        slowdown: its prior step-time factor (:func:`expected_slowdown`).
        report: the prediction -- per-axis (``report.meta["method"] == "per-axis"``), a full
            :func:`estimate_memory` (``"full"``), or a lower bound (``"lower bound"``: the model-side run
            stopped as soon as it passed the budget); ``None`` when it could not be estimated.
        fits: whether the prediction fits the usable budget.
        error: why it could not be estimated.
        per_axis_peak_bytes: for a candidate estimated in full after its per-axis prediction, that
            prediction (the chosen candidate always has both).
    """

    config: TrainingConfig
    slowdown: float
    report: MemoryReport | None = None
    fits: bool | None = None
    error: str | None = None
    per_axis_peak_bytes: int | None = None

    @property
    def predicted_peak_bytes(self) -> int | None:
        return self.report.peak_bytes if self.report is not None else None

    @property
    def method(self) -> str | None:
        """``"full"``, ``"per-axis"`` or ``"lower bound"``: how ``report`` was made."""
        return self.report.meta.get("method", "full") if self.report is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "label": self.config.describe(),
            "slowdown": round(self.slowdown, 3),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "method": self.method,
            "per_axis_peak_bytes": self.per_axis_peak_bytes,
            "fits": self.fits,
            "error": self.error,
        }


@dataclass
class Plan:
    """The chosen configuration and every candidate looked at.

    Attributes:
        chosen: the fitting candidate with the lowest expected slowdown; its ``report`` is a full
            :func:`estimate_memory`.
        candidates: all evaluated candidates, in the order they were tried.
        budget_bytes: the budget asked for.
        usable_bytes: the budget less the safety margin (and device overheads for CUDA).
        baseline: the configuration as the user asked for it (precision + optimizer, no technique),
            always predicted, so a plan shows what it saves.
        optimizer_kwargs: arguments the chosen optimizer needs beyond the configured ones: ``{"lr": ...}``
            (:data:`DEFAULT_LR`) when the plan changed the optimizer family, else empty.
        optimizer: the chosen optimizer to train with, as one config: the hyperparameters asked for that it
            takes (its family's), or ``optimizer_kwargs`` (a new family's learning rate). ``None``: not set.
        notes: facts about the search (estimates run, per-axis vs full figure of the chosen plan).
        seconds: how long the search took (wall clock).
    """

    chosen: Candidate
    candidates: list[Candidate]
    budget_bytes: int
    usable_bytes: int
    device: str = "cuda"
    baseline: Candidate | None = None
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    optimizer: OptimizerConfig | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def config(self) -> TrainingConfig:
        return self.chosen.config

    @property
    def skipped(self) -> dict[str, list[str]]:
        """Candidates that could not be built on this model, by reason: ``{error: [labels]}`` (e.g. checkpointing
        ``"auto"`` on a model with no repeated blocks). The search went on without them."""
        reasons: dict[str, list[str]] = {}
        for candidate in self.candidates:
            if candidate.error:
                reasons.setdefault(candidate.error, []).append(candidate.config.describe())
        return reasons

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
            "optimizer_kwargs": dict(self.optimizer_kwargs),
            "optimizer": (
                {"name": self.optimizer.name, "hyperparameters": self.optimizer.kwargs} if self.optimizer else None
            ),
            "candidates": [c.to_dict() for c in self.candidates],
            "skipped": self.skipped,
            "notes": self.notes,
            "seconds": round(self.seconds, 2),
        }

    def to_table(self) -> Any:
        """A Rich table: config -> predicted peak -> fits?, the chosen row marked."""
        from rich.table import Table

        skipped = [f"skipped {len(labels)} that cannot be built: {reason}" for reason, labels in self.skipped.items()]
        table = Table(
            title=f"Memory plan: budget {format_bytes(self.budget_bytes)} "
            f"(usable {format_bytes(self.usable_bytes)} on {self.device})",
            caption="\n".join(skipped) or None,
        )
        table.add_column("configuration")
        table.add_column("predicted peak", justify="right")
        table.add_column("estimate", justify="center")
        table.add_column("slowdown (prior)", justify="right")
        table.add_column("fits?", justify="center")
        for candidate in self.candidates:
            chosen = candidate is self.chosen
            label = candidate.config.describe()
            if candidate is self.baseline and not chosen:
                label += " (as configured)"
            fits = "-" if candidate.fits is None else ("yes" if candidate.fits else "no")
            fits = "skipped" if candidate.error else fits
            table.add_row(
                ("[bold green]> " if chosen else "  ") + label + ("[/]" if chosen else ""),
                peak_label(candidate),
                candidate.method or "-",
                f"{candidate.slowdown:.2f}x",
                fits,
            )
        return table


def peak_label(candidate: Candidate) -> str:
    peak = candidate.predicted_peak_bytes
    if peak is None:
        return candidate.error or "-"
    return (">= " if candidate.method == "lower bound" else "") + format_bytes(peak)


@contextlib.contextmanager
def rich_progress(console: Any) -> Iterator[Callable[[Candidate, int, int], None]]:
    """A ``progress`` callback for :func:`~lightning_lowmem.planning.plan.plan_memory` that shows the search.

    On a terminal: a Rich progress bar (candidate, predicted peak, count, elapsed time), removed when the
    search ends. Elsewhere (a pipe, a CI log): one line per candidate, ``[index/total] label: peak (fits)``.

    Args:
        console: a ``rich.console.Console`` (e.g. ``Console(stderr=True)``).

    Example::

        >>> from rich.console import Console
        >>> import io
        >>> console = Console(file=io.StringIO())
        >>> with rich_progress(console) as progress:
        ...     pass
    """
    if not console.is_terminal:
        started = time.perf_counter()

        def line(candidate: Candidate, index: int, total: int) -> None:
            fits = "-" if candidate.fits is None else ("fits" if candidate.fits else "over")
            console.print(
                f"plan [{index}/{total}] {candidate.config.describe()}: {peak_label(candidate)} ({fits}) "
                f"{time.perf_counter() - started:.1f} s",
                markup=False,
                highlight=False,
                soft_wrap=True,  # one line per candidate in a log, whatever its width (it wrapped at 80 columns)
            )

        yield line
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("planning", total=None)

        def update(candidate: Candidate, index: int, total: int) -> None:
            bar.update(
                task,
                completed=index,
                total=total,
                description=f"{candidate.config.describe()}: {peak_label(candidate)}",
            )

        yield update


def short_error(err: BaseException) -> str:
    """``"TypeName: first sentence"`` of an error (at most 160 characters), for a skipped candidate."""
    text = str(err).splitlines()[0] if str(err) else ""
    text = text.split(". ")[0].rstrip(".")
    return f"{type(err).__name__}: {text[:160]}"


def no_fit_error(evaluated: list[Candidate], budget: Any, usable: int, margin: float) -> ValueError:
    """The error of a search where nothing fits: the smallest predicted peak and its configuration."""
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
