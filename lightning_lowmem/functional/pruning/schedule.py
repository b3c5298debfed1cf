"""When a pruning run prunes: the argument checks :class:`~lightning_lowmem.functional.config.PruningConfig` runs
and the step-schedule bookkeeping of ``ScheduledPruning``.

:class:`PruningSchedule` holds the window (``start_step``, ``end_step``, ``frequency``) and the
``step -> sparsity`` function of a step-mode run; ``end_step=None`` is resolved later, once the run's
last step is known (:meth:`PruningSchedule.resolve_end_step`). :func:`method_name` and
:func:`check_amount` validate the ``ModelPruning``-compatible arguments. Nothing here holds training
state: the callback keeps the last pruned step and decides when to call these.
"""

from __future__ import annotations

from typing import Any, Callable, Union

from torch.nn.utils import prune as torch_prune

from lightning_lowmem.functional.config.constants import PRUNING_METHODS as METHODS
from lightning_lowmem.schedules import SCHEDULES, build_schedule

__all__ = ["PruningSchedule", "check_amount", "check_start_step", "method_name"]

_TORCH_FUNCTION_NAMES = ("l1_unstructured", "random_unstructured", "ln_structured", "random_structured")
Amount = Union[int, float, Callable[[int], Union[int, float]]]


def method_name(pruning_fn: Any, argument: str = "pruning_fn") -> Any:
    """Map ``torch.nn.utils.prune.l1_unstructured`` (the function) to its name; keep strings/classes.

    Raises:
        ValueError: an unknown method name.
        TypeError: neither a name, a ``torch.nn.utils.prune`` function of those names, nor a
            ``BasePruningMethod`` subclass.

    Example::

        >>> method_name(torch_prune.l1_unstructured), method_name("NM")
        ('l1_unstructured', 'nm')
    """
    if isinstance(pruning_fn, str):
        name = pruning_fn.lower()
        if name not in METHODS:
            raise ValueError(f"`{argument}`={pruning_fn!r} is unknown; choose one of {list(METHODS)}")
        return name
    if isinstance(pruning_fn, type) and issubclass(pruning_fn, torch_prune.BasePruningMethod):
        return pruning_fn
    if callable(pruning_fn) and getattr(pruning_fn, "__name__", None) in _TORCH_FUNCTION_NAMES:
        return pruning_fn.__name__
    raise TypeError(
        f"`{argument}`={pruning_fn!r} must be one of {list(METHODS)}, a torch.nn.utils.prune function of those"
        " names, or a torch.nn.utils.prune.BasePruningMethod subclass"
    )


def check_amount(amount: Amount) -> None:
    """``ModelPruning``'s ``amount``: a float in [0, 1], an int >= 0 or a ``callable(epoch)``.

    Raises:
        TypeError / ValueError: anything else (the message names the value and what is allowed).
    """
    if callable(amount):
        return
    if isinstance(amount, bool) or not isinstance(amount, (int, float)):
        raise TypeError(f"`amount`={amount!r} must be a float in [0, 1], an int >= 0 or a callable(epoch)")
    if isinstance(amount, int) and amount < 0:
        raise ValueError(
            f"`amount`={amount} must be >= 0 when an int (a number of weights); allowed: int >= 0 or float in [0, 1]"
        )
    if isinstance(amount, float) and not 0.0 <= amount <= 1.0:
        raise ValueError(f"`amount`={amount} must be in [0, 1] when a float; allowed: int >= 0 or float in [0, 1]")


def check_start_step(start_step: Any) -> None:
    if not isinstance(start_step, int) or start_step < 0:
        raise ValueError(f"`start_step`={start_step!r} must be an int >= 0")


class PruningSchedule:
    """The step-mode schedule of a pruning run: which optimizer steps prune, and to what sparsity.

    Args:
        schedule: ``"constant"``, ``"linear"``, ``"cubic"``, ``"exponential"`` or ``callable(step)``.
            Default: ``"cubic"``.
        final_sparsity: sparsity reached at ``end_step`` (a float in [0, 1] unless ``schedule`` is a
            callable). Default: 0.5.
        start_step, end_step, frequency: the window and period in optimizer steps; ``end_step=None``
            until :meth:`resolve_end_step`. Defaults: 0, ``None``, 1.
        initial_sparsity: sparsity at ``start_step``. Default: 0.0.

    Raises:
        ValueError: unknown ``schedule``, ``final_sparsity`` outside [0, 1], a bad window (see
            :class:`~lightning_lowmem.schedules.SparsitySchedule`).

    Example::

        >>> schedule = PruningSchedule("cubic", 0.8, start_step=0, end_step=10, frequency=5)
        >>> [schedule.is_pruning_step(step) for step in (0, 3, 5, 10, 11)], round(schedule.sparsity_at(5), 3)
        ([True, False, True, True, False], 0.7)
    """

    def __init__(
        self,
        schedule: str | Callable[[int], float] = "cubic",
        final_sparsity: Any = 0.5,
        start_step: int = 0,
        end_step: int | None = None,
        frequency: int = 1,
        initial_sparsity: float = 0.0,
    ) -> None:
        if isinstance(schedule, str) and schedule not in SCHEDULES:
            raise ValueError(
                f"`schedule`={schedule!r} is unknown; choose one of {list(SCHEDULES)} or pass a callable(step)"
            )
        custom = callable(schedule) and not isinstance(schedule, str)
        if not custom and not (isinstance(final_sparsity, float) and 0.0 <= final_sparsity <= 1.0):
            raise ValueError(f"`target_sparsity`={final_sparsity!r} must be a float in [0, 1] for a step schedule")
        self.kind, self.final_sparsity, self.initial_sparsity = schedule, final_sparsity, initial_sparsity
        self.start_step, self.frequency = start_step, frequency
        self.end_step: int | None = None
        self.function: Callable[[int], float] | None = None
        if end_step is not None:
            self.resolve_end_step(end_step)  # validates start/end/frequency now
        else:
            check_start_step(start_step)

    def resolve_end_step(self, end_step: int) -> Callable[[int], float]:
        """Build the ``step -> sparsity`` function for a window ending at ``end_step``."""
        final = self.final_sparsity if not callable(self.final_sparsity) else 0.0
        self.function = build_schedule(
            self.kind, final, self.start_step, end_step, self.frequency, self.initial_sparsity
        )
        self.end_step = end_step
        return self.function

    def resolve_last_step(self, last_step: int) -> None:
        """``end_step=None``: the window ends at the run's last step.

        Raises:
            ValueError: ``last_step`` is not after ``start_step``.
        """
        if last_step <= self.start_step:
            raise ValueError(
                f"`end_step`=None resolves to the run's last step {last_step}, which is not > `start_step`; set `end_step`"
            )
        self.resolve_end_step(last_step)

    def is_pruning_step(self, step: int) -> bool:
        """On the ``frequency`` grid inside ``[start_step, end_step]``, or the final step."""
        assert self.end_step is not None, "resolve_end_step() first"
        if not self.start_step <= step <= self.end_step:
            return False
        return (step - self.start_step) % self.frequency == 0 or step == self.end_step

    def sparsity_at(self, step: int) -> float:
        """The target sparsity at ``step``.

        Raises:
            ValueError: a user ``schedule`` returned a value outside [0, 1].
        """
        assert self.function is not None, "resolve_end_step() first"
        target = float(self.function(step))
        if not 0.0 <= target <= 1.0:
            raise ValueError(f"`schedule`({step}) returned {target!r}; a sparsity must be in [0, 1]")
        return target
