"""`MemoryReport`: the peak of a step, split into the categories every feature reports through."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_lowmem.memory.units import format_bytes

CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "activations", "other")
"""Breakdown keys, in display order. ``parameters`` includes buffers; ``other`` is inputs, outputs and
temporaries that are neither saved for backward nor model / optimizer state (``MemoryReport.other_breakdown``
says which)."""

PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")


@dataclass
class MemoryReport:
    """Peak memory of a measured (or estimated) piece of work, with its breakdown.

    Attributes:
        peak_bytes: the highest number of bytes live at once on ``device``.
        breakdown: bytes per category at the moment of the peak; sums to ``peak_bytes``.
        device: ``"cpu"`` or ``"cuda"`` (the device type the bytes were counted on).
        phases: per phase (``forward``, ``backward``, ``optimizer``) its own peak (``peak_bytes``), the
            categories at that moment (``breakdown``) and what its ``other`` bytes are (``other``, as
            ``other_breakdown``); a phase that never ran is absent.
        by_module: per module name, ``peak_bytes`` (highest live bytes while its forward ran) and
            ``retained_bytes`` (bytes its forward left alive, i.e. what it holds for backward).
        other_breakdown: what ``breakdown["other"]`` is at the peak, by where it was made: ``"loss / logits"``
            (after the output head ran), ``"attention"``, ``"activation packing"`` (compression's pack /
            unpack), ``"forward temporaries"``, ``"backward temporaries"``, ``"optimizer step"``, ``"inputs"``
            (alive before the work began), ``"communication buffers"``; kinds with no bytes are left out.
        end_bytes: bytes still live when the measured work ended.
        device_stats: what the device itself reports (CUDA allocator: ``max_allocated``,
            ``max_reserved``, ``fragmentation``; CPU: ``rss_before`` / ``rss_after``).
        overheads: memory outside the tensor count (estimates only): e.g. ``cuda_context``; not in
            ``peak_bytes``.
        source: ``"measured"`` or ``"estimated"``.
        meta: free-form facts about the run (configuration of an estimate, step count, ...).
    """

    peak_bytes: int
    breakdown: dict[str, int]
    device: str = "cpu"
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    by_module: dict[str, dict[str, int]] = field(default_factory=dict)
    other_breakdown: dict[str, int] = field(default_factory=dict)
    end_bytes: int = 0
    device_stats: dict[str, int] = field(default_factory=dict)
    overheads: dict[str, int] = field(default_factory=dict)
    source: str = "measured"
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [c for c in CATEGORIES if c not in self.breakdown]
        if missing:
            raise ValueError(f"`breakdown` lacks categories {missing}; expected all of {list(CATEGORIES)}")

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state at the peak."""
        return sum(self.breakdown[c] for c in ("parameters", "gradients", "optimizer_state"))

    @property
    def total_with_overheads(self) -> int:
        """``peak_bytes`` plus the listed overheads (e.g. the CUDA context)."""
        return self.peak_bytes + sum(self.overheads.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def to_table(self, title: str | None = None, top_modules: int = 8) -> Any:
        """A Rich ``Table``: the categories at the peak and at each phase's own peak (a column per phase), what
        ``other`` is, and the largest modules.

        Example::

            >>> report = MemoryReport(100, {"parameters": 60, "gradients": 0, "optimizer_state": 0, "activations": 30,
            ...                       "other": 10}, other_breakdown={"loss / logits": 10},
            ...                       phases={"forward": {"peak_bytes": 100, "breakdown": {"activations": 30}}})
            >>> [column.header for column in report.to_table().columns]
            ['what', 'step peak', 'share', 'forward']
        """
        from rich.table import Table

        phases = [phase for phase in PHASES if phase in self.phases]
        caption = f"{' / '.join(phases)}: the categories at that phase's own peak" if phases else None
        table = Table(title=title or f"Peak memory ({self.source}, {self.device})", show_lines=False, caption=caption)
        table.add_column("what", style="bold", no_wrap=True)
        table.add_column("step peak", justify="right")
        table.add_column("share", justify="right")
        for phase in phases:
            table.add_column(phase, justify="right")

        def by_phase(key: str, category: str) -> list[str]:
            return [format_bytes(self.phases[p].get(key, {}).get(category, 0)) for p in phases]

        for category in CATEGORIES:
            value = self.breakdown[category]
            share = f"{100 * value / self.peak_bytes:.1f}%" if self.peak_bytes else "-"
            table.add_row(category, format_bytes(value), share, *by_phase("breakdown", category))
            if category == "other":
                in_phases = [kind for p in phases for kind in self.phases[p].get("other", {})]
                kinds = dict.fromkeys([*self.other_breakdown, *in_phases])
                for kind in kinds:
                    value = self.other_breakdown.get(kind, 0)
                    share = f"{100 * value / self.peak_bytes:.1f}%" if self.peak_bytes else "-"
                    table.add_row(f"  {kind}", format_bytes(value), share, *by_phase("other", kind))
        table.add_row(
            "[bold]peak[/bold]",
            f"[bold]{format_bytes(self.peak_bytes)}[/bold]",
            "100%",
            *(format_bytes(self.phases[p]["peak_bytes"]) for p in phases),
            end_section=True,
        )
        blank = [""] * len(phases)
        for name, value in self.device_stats.items():
            table.add_row(f"device: {name}", format_bytes(value), "", *blank)
        for name, value in self.overheads.items():
            table.add_row(f"+ {name} (not in peak)", format_bytes(value), "", *blank)
        ranked = sorted(self.by_module.items(), key=lambda kv: kv[1]["retained_bytes"], reverse=True)
        for name, stats in ranked[:top_modules]:
            table.add_row(f"module {name or '<root>'} holds", format_bytes(stats["retained_bytes"]), "", *blank)
        return table

    def __str__(self) -> str:
        parts = ", ".join(f"{c}={format_bytes(self.breakdown[c])}" for c in CATEGORIES)
        return f"MemoryReport({self.source}, {self.device}, peak={format_bytes(self.peak_bytes)}: {parts})"
