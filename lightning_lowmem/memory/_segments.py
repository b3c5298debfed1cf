"""A tracked run cut into segments at named modules' first forwards: each segment's peak and the state it began in.

The planner's depth bound (``planning/_depth.py``) reads a 3-block copy's forward as three segments (up to the
second block, the second block, the rest) to know the 2-block copy's forward without running it. The tracker
(``_tracker.py``) feeds :class:`SegmentPeaks` its live total after each allocation and the module forwards that
start; the snapshots kept here get the same later corrections as the tracker's own (a storage relabelled, or first
seen, after they were taken), so every figure is in the labels the run ends with.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from lightning_lowmem.memory._tensors import plain_tensors
from lightning_lowmem.memory.report import CATEGORIES


class SegmentPeaks:
    """The segments' figures of one tracker's run (none until :meth:`cut_at` names the modules)."""

    def __init__(self, tracker: Any) -> None:
        self._tracker = tracker
        self.marks: tuple[str, ...] = ()
        self._held: list[torch.Tensor] = []
        self.starts: list[Any] = []
        """The live state as each mark's forward starts."""
        self.peaks: list[Any] = []
        """The peak of each segment: before the first mark, then from each mark to the next (or the end)."""
        self.held: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        """The bytes of :meth:`cut_at`'s ``held`` tensors by category, read as the first mark's forward starts."""

    def cut_at(self, marks: tuple[str, ...], held: Iterable[torch.Tensor] = ()) -> None:
        """Cut the run at the first forward of each module named in ``marks`` (qualified names in the tracked
        module, in the order their forwards start; a later forward, e.g. a checkpoint's recomputation, does not cut)
        or at :meth:`cut` with that name; ``held``: tensors whose live bytes are read at the first cut
        (:attr:`held`)."""
        self.marks, self._held = tuple(marks), list(held)

    def cut(self, name: str) -> None:
        """Cut here if ``name`` is the next mark (for a mark that is no module forward: e.g. a backward hook's)."""
        self._tracker._count_held_sum()
        self.enter(name)

    def enter(self, name: str | None) -> None:
        """A module forward starts (``name``: its qualified name in the tracked module)."""
        if len(self.starts) == len(self.marks) or name != self.marks[len(self.starts)]:
            return
        tracker = self._tracker
        if not self.starts:  # the first segment's peak is the run's so far: a copy, corrected from now on
            self.peaks.append(_copy(tracker._peak))
            self._read_held()
        start = tracker._snapshot_now(None)
        self.starts.append(start)
        self.peaks.append(_copy(start))

    def peak(self, total: int, seq: int) -> None:
        """The live total after allocation ``seq``."""
        if self.starts and total > self.peaks[-1].total:
            self.peaks[-1] = self._tracker._snapshot_now(seq)

    def snapshots(self) -> Iterator[Any]:
        """Every snapshot kept (for the tracker's corrections)."""
        yield from self.starts
        yield from self.peaks

    def _read_held(self) -> None:
        tracker, seen = self._tracker, set()
        for tensor in self._held:
            for plain in plain_tensors(tensor):
                key = tracker._key(plain)
                record = tracker._records.get(key) if key is not None else None
                if record is not None and key not in seen:
                    seen.add(key)
                    self.held[record.category] += record.nbytes


def _copy(snapshot: Any) -> Any:
    return type(snapshot)(snapshot.total, snapshot.seq, dict(snapshot.breakdown), dict(snapshot.other))
