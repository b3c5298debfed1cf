"""Sparsity schedules: the target sparsity as a pure function of the optimizer step.

A schedule maps ``step -> sparsity in [0, 1]``. Before ``start_step`` it returns 0 (nothing is pruned yet),
from ``end_step`` on it returns ``final_sparsity``, and between the two it follows its curve, updated
only every ``frequency`` steps (the value is held in between, as in Zhu & Gupta 2017).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Union

__all__ = ["SCHEDULES", "SparsitySchedule", "build_schedule"]

SCHEDULES = ("constant", "linear", "cubic", "exponential")
ScheduleLike = Union[str, Callable[[int], float], "SparsitySchedule"]


def _check_fraction(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"`{name}`={value!r} must be a float in [0, 1] (a fraction of the prunable weights)")


@dataclass(frozen=True)
class SparsitySchedule:
    """Sparsity as a function of the step.

    Args:
        kind: ``"constant"`` (``final_sparsity`` from ``start_step`` on), ``"linear"``, ``"cubic"``
            (Zhu & Gupta 2017: ``s_t = s_f + (s_i - s_f) * (1 - (t - t0) / (end - t0)) ** 3``) or
            ``"exponential"`` (the kept fraction decays geometrically from ``1 - s_i`` to ``1 - s_f``).
            Default: ``"cubic"``.
        final_sparsity: sparsity reached at ``end_step``. Default: 0.5.
        start_step: first step that prunes. Default: 0.
        end_step: step at which ``final_sparsity`` is reached. Default: 1000.
        frequency: prune every ``frequency`` steps between start and end. Default: 1.
        initial_sparsity: sparsity at ``start_step`` (``s_i``). Default: 0.0.

    Raises:
        ValueError: unknown ``kind``, a sparsity outside [0, 1], ``end_step <= start_step``,
            a negative ``start_step`` or ``frequency < 1``.

    Example::

        >>> schedule = SparsitySchedule("cubic", final_sparsity=0.8, start_step=0, end_step=10)
        >>> schedule(0), schedule(10), round(schedule(5), 3)
        (0.0, 0.8, 0.7)
    """

    kind: str = "cubic"
    final_sparsity: float = 0.5
    start_step: int = 0
    end_step: int = 1000
    frequency: int = 1
    initial_sparsity: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"`schedule`={self.kind!r} is unknown; choose one of {list(SCHEDULES)} or pass a callable")
        _check_fraction("target_sparsity", self.final_sparsity)
        _check_fraction("initial_sparsity", self.initial_sparsity)
        if not isinstance(self.start_step, int) or self.start_step < 0:
            raise ValueError(f"`start_step`={self.start_step!r} must be an int >= 0")
        if not isinstance(self.end_step, int) or self.end_step <= self.start_step:
            raise ValueError(
                f"`end_step`={self.end_step!r} must be an int > `start_step`={self.start_step}"
                " (the schedule needs at least one step to ramp)"
            )
        if not isinstance(self.frequency, int) or self.frequency < 1:
            raise ValueError(f"`frequency`={self.frequency!r} must be an int >= 1 (prune every `frequency` steps)")

    def is_pruning_step(self, step: int) -> bool:
        """Whether masks should be recomputed at ``step``: on the frequency grid, or the final step."""
        if step < self.start_step or step > self.end_step:
            return False
        return (step - self.start_step) % self.frequency == 0 or step == self.end_step

    def __call__(self, step: int) -> float:
        if step < self.start_step:
            return 0.0
        if step >= self.end_step:
            return float(self.final_sparsity)
        if self.kind == "constant":
            return float(self.final_sparsity)
        # hold the value between pruning steps: t is the last step on the frequency grid
        t = self.start_step + (step - self.start_step) // self.frequency * self.frequency
        progress = (t - self.start_step) / (self.end_step - self.start_step)  # in [0, 1)
        s_i, s_f = float(self.initial_sparsity), float(self.final_sparsity)
        if self.kind == "linear":
            return s_i + (s_f - s_i) * progress
        if self.kind == "cubic":
            return s_f + (s_i - s_f) * (1.0 - progress) ** 3
        # exponential: kept fraction (1 - s) interpolates geometrically
        kept_i, kept_f = max(1.0 - s_i, 1e-12), max(1.0 - s_f, 1e-12)
        return 1.0 - kept_i * math.exp(progress * math.log(kept_f / kept_i))


def build_schedule(
    schedule: ScheduleLike,
    final_sparsity: float = 0.5,
    start_step: int = 0,
    end_step: int = 1000,
    frequency: int = 1,
    initial_sparsity: float = 0.0,
) -> Callable[[int], float]:
    """Return a ``step -> sparsity`` function from a name, a :class:`SparsitySchedule` or a callable.

    A user callable is used as given (it receives the step and returns a sparsity in [0, 1]);
    values outside [0, 1] are rejected when it is called by the pruning callback.

    Raises:
        TypeError: ``schedule`` is neither a string nor callable.
        ValueError: see :class:`SparsitySchedule`.

    Example::

        >>> build_schedule("linear", 0.5, 0, 10)(5)
        0.25
    """
    if isinstance(schedule, SparsitySchedule) or (callable(schedule) and not isinstance(schedule, str)):
        return schedule
    if not isinstance(schedule, str):
        raise TypeError(
            f"`schedule` must be one of {list(SCHEDULES)} or a callable(step) -> sparsity, got {type(schedule).__name__}"
        )
    return SparsitySchedule(schedule, final_sparsity, start_step, end_step, frequency, initial_sparsity)
