"""Storages no tensor op shows the tracker: resized in place (FSDP2), or made by a communication backend."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class UnseenAllocations:
    """The part of :class:`~lightning_lowmem.memory._tracker.StorageTracker` that counts what its dispatch mode
    cannot see: ``resized``, ``backend_allocations``, ``unseen_bytes`` (used by ``planning/sharding.py``); the
    counters it changes are the tracker's."""

    def resized(self, tensor: torch.Tensor) -> None:
        """Count a storage resized in place (no tensor op a dispatch mode sees), e.g. by FSDP2."""
        self._count_held_sum()
        self._allocate(tensor)

    @contextlib.contextmanager
    def backend_allocations(self) -> Iterator[None]:
        """Inside: a storage first seen was allocated just now by a communication backend, not before tracking.

        A collective's backend may allocate in its own thread, where this (thread-local) dispatch mode sees
        nothing; gloo's reduce-scatter, for one, reduces a copy of its input and reads it back in the caller's
        thread when the work is waited on. Seen there for the first time, such a storage would otherwise count
        as alive since tracking began (the rule for storages made before tracking), once for every
        collective of the step, all at the same snapshot.
        """
        self._backend_depth += 1
        try:
            yield
        finally:
            self._backend_depth -= 1

    @contextlib.contextmanager
    def unseen_bytes(self, nbytes: int) -> Iterator[None]:
        """Inside: ``nbytes`` more are live, as ``other``, that no tensor op ever shows (a communication backend's
        staging buffer, made and freed in its own threads; e.g. gloo's all-gather holds one of the output's size).
        """
        nbytes = self.round_bytes(nbytes) if nbytes > 0 else 0
        self._count_held_sum()
        self._current["other"] += nbytes
        self._current_other["communication buffers"] += nbytes
        self._total += nbytes
        if not self._stopped:
            self._update_peaks(next(self._seq))
        try:
            yield
        finally:
            self._current["other"] -= nbytes
            self._current_other["communication buffers"] -= nbytes
            self._total -= nbytes
