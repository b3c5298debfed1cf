"""Per-module forward figures of a tracked step (``MemoryReport.by_module``).

For each named module: the live bytes' peak while one of its forwards ran (``peak_bytes``), what its forwards
left alive when they returned (``retained_bytes``, summed over calls) and how often it ran (``calls``). The
tracker passes the live total at each module forward's start and end and at each new peak.
"""

from __future__ import annotations

from torch import nn


class ModulePeaks:
    """The ``by_module`` figures, fed by the tracker's module forward hooks.

    Args:
        module_names: ``{id(module): qualified name}`` of the tracked modules; others are not counted.
    """

    def __init__(self, module_names: dict[int, str]) -> None:
        self.module_names = module_names
        self._stack: list[tuple[str, int]] = []  # (name, live bytes at its start) of the forwards running
        self.stats: dict[str, dict[str, int]] = {}

    def enter(self, module: nn.Module, total: int) -> None:
        """A forward of ``module`` starts with ``total`` bytes live."""
        name = self.module_names.get(id(module))
        if name is None:
            return
        self.stats.setdefault(name, {"peak_bytes": 0, "retained_bytes": 0, "calls": 0})
        self._stack.append((name, total))
        stats = self.stats[name]
        stats["peak_bytes"] = max(stats["peak_bytes"], total)

    def exit(self, module: nn.Module, total: int) -> None:
        """A forward of ``module`` returned with ``total`` bytes live."""
        name = self.module_names.get(id(module))
        if name is None or not self._stack or self._stack[-1][0] != name:
            return
        _, start_total = self._stack.pop()
        stats = self.stats[name]
        stats["retained_bytes"] += total - start_total
        stats["calls"] += 1

    def peak(self, total: int) -> None:
        """``total`` bytes are live now: a new peak for every forward running."""
        for name, _ in self._stack:
            stats = self.stats[name]
            stats["peak_bytes"] = max(stats["peak_bytes"], total)

    def seen_late(self, nbytes: int) -> None:
        """``nbytes`` existed before tracking but were first seen now: they were live at every peak so far."""
        for stats in self.stats.values():
            stats["peak_bytes"] += nbytes

    def report(self) -> dict[str, dict[str, int]]:
        """``{module name: {"peak_bytes", "retained_bytes", "calls"}}``."""
        return {name: dict(stats) for name, stats in self.stats.items()}
