"""Checks of ``ScheduledPruning``'s argument combinations, pure (no model, no Trainer): the method and its
alias, ``parameter_names``, ``n``/``m``, ``verbose``, ``structural_ratio``, and the step-mode schedule they
ask for. The errors name the argument, the value received and what is allowed."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from lightning_lowmem.functional.pruning.schedule import Amount, PruningSchedule, check_amount, check_start_step, method_name

__all__ = ["check_pruning_arguments", "resolve_method", "step_schedule"]


def resolve_method(pruning_fn: Any, method: str | None = None) -> Any:
    """The pruning method named by ``pruning_fn`` or its alias ``method`` (see :func:`method_name`).

    Raises:
        ValueError: ``method`` and a non-default ``pruning_fn`` disagree; an unknown method name.
        TypeError: ``pruning_fn`` is not a name, a ``torch.nn.utils.prune`` function or a method class.

    Example::

        >>> resolve_method("l1_unstructured", method="nm"), resolve_method("random_unstructured")
        ('nm', 'random_unstructured')
    """
    if method is not None:
        if pruning_fn not in ("l1_unstructured", method):
            raise ValueError(f"`method`={method!r} and `pruning_fn`={pruning_fn!r} disagree; pass only one")
        pruning_fn = method
    return method_name(pruning_fn)


def check_pruning_arguments(
    method: Any,
    parameter_names: Sequence[Any],
    amount: Amount,
    *,
    n: int = 2,
    m: int = 4,
    verbose: int = 0,
    structural_ratio: float | None = None,
) -> None:
    """Raise if ``ScheduledPruning``'s pure arguments are malformed (``method`` as :func:`resolve_method` returns).

    Raises:
        ValueError: an empty or non-string parameter name, ``n``/``m`` not ints with ``1 <= n < m`` for
            ``"nm"``, ``verbose`` not 0/1/2, ``structural_ratio`` outside [0, 1), a bad ``amount``.
        TypeError: ``amount`` neither a number nor a callable.

    Example::

        >>> check_pruning_arguments("nm", ["weight"], 0.5, n=4, m=4)
        Traceback (most recent call last):
        ...
        ValueError: `n`=4, `m`=4: N:M pruning needs ints with 1 <= n < m (e.g. n=2, m=4)
    """
    for name in parameter_names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"`parameter_names` entries must be parameter names like 'weight', got {name!r}")
    check_amount(amount)
    if method == "nm" and (not isinstance(n, int) or not isinstance(m, int) or not 1 <= n < m):
        raise ValueError(f"`n`={n!r}, `m`={m!r}: N:M pruning needs ints with 1 <= n < m (e.g. n=2, m=4)")
    if verbose not in (0, 1, 2):
        raise ValueError(f"`verbose`={verbose!r} must be 0, 1 or 2")
    if structural_ratio is not None and not 0.0 <= structural_ratio < 1.0:
        raise ValueError(f"`structural_ratio`={structural_ratio!r} must be in [0, 1)")


def step_schedule(
    schedule: str | Callable[[int], float] | None,
    final_sparsity: Amount,
    start_step: int = 0,
    end_step: int | None = None,
    frequency: int = 1,
    initial_sparsity: float = 0.0,
    *,
    step_mode: bool,
) -> PruningSchedule | None:
    """The step-mode :class:`PruningSchedule` (``"cubic"`` when ``schedule`` is ``None``), or ``None`` in
    epoch mode, where only ``start_step`` is checked.

    Example::

        >>> step_schedule(None, 0.8, end_step=10, step_mode=True).sparsity_at(10)
        0.8
        >>> step_schedule(None, 0.5, step_mode=False) is None
        True
    """
    if not step_mode:
        check_start_step(start_step)
        return None
    return PruningSchedule(schedule or "cubic", final_sparsity, start_step, end_step, frequency, initial_sparsity)
