"""The pruning config: every argument of :class:`~lightning_lowmem.callbacks.ScheduledPruning` (Lightning
``ModelPruning``'s, plus the step schedule, N:M and structural removal), validated once, where it is written.

``ScheduledPruning(...)`` builds one from its keyword arguments (so LightningCLI YAML is unchanged) and
decides *when* to prune; :func:`~lightning_lowmem.functional.pruning.prune_` accepts one for a one-shot prune
to its final sparsity. No Lightning import.

Example::

    >>> config = PruningConfig(method="nm", target_sparsity=0.5, end_step=100)
    >>> config.pruning_fn, config.step_mode, config.final_sparsity
    ('nm', True, 0.5)
    >>> PruningConfig(verbose=3)
    Traceback (most recent call last):
    ...
    ValueError: `verbose`=3 must be 0, 1 or 2 (0 silent, 1 total sparsity, 2 per layer)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from lightning_lowmem.functional.config.techniques import check_bool

if TYPE_CHECKING:
    from lightning_lowmem.functional.pruning.schedule import Amount, PruningSchedule


def _schedule() -> Any:
    """The pruning package's argument checks, imported when a config is built: importing them here at import time
    would import ``functional.pruning`` while ``functional.config`` is still half-initialised (they import it)."""
    from lightning_lowmem.functional.pruning import schedule

    return schedule


__all__ = ["DEFAULT_PARAMETER_NAMES", "PruningConfig"]

#: what is pruned in each module when ``parameter_names`` is not given (as Lightning's ``ModelPruning``).
DEFAULT_PARAMETER_NAMES: tuple[str, ...] = ("weight", "bias")


def _check_bool_or_callable(name: str, value: Any) -> None:
    if not (isinstance(value, bool) or callable(value)):
        raise TypeError(
            f"`{name}` must be True, False or a callable(epoch) -> bool, got {type(value).__name__}: {value!r}"
        )


def _as_tuple(value: Any) -> Any:
    """YAML's lists as tuples (the config is hashable and compares by value); pairs stay pairs."""
    if isinstance(value, list):
        return tuple(_as_tuple(item) for item in value)
    if isinstance(value, tuple):
        return tuple(_as_tuple(item) for item in value)
    return value


@dataclass(frozen=True)
class PruningConfig:
    """Pruning: which method, which parameters, how much and on which schedule (``ScheduledPruning``'s arguments).

    Without ``schedule`` / ``target_sparsity`` a run prunes per epoch like ``ModelPruning`` (``amount`` of the
    still-unpruned weights at each epoch end where ``apply_pruning(epoch)`` holds); with them, the sparsity
    follows ``schedule(step)`` from ``start_step`` to ``end_step`` ("step mode").

    Args:
        pruning_fn: ``"l1_unstructured"``, ``"random_unstructured"``, ``"ln_structured"``,
            ``"random_structured"``, ``"nm"``, a ``torch.nn.utils.prune`` function of those names, or a
            ``BasePruningMethod`` subclass. Held resolved (a name, or the class). Default: ``"l1_unstructured"``.
        parameters_to_prune: ``(module, "weight")`` pairs or ``"module.fqn.param"`` strings; empty = every
            module's ``parameter_names``. Default: ``()``.
        parameter_names: names pruned in each module; ``None`` = :data:`DEFAULT_PARAMETER_NAMES`. Default: ``None``.
        use_global_unstructured: rank across all tensors. Default: ``True``.
        amount: float in [0, 1], int >= 0 or ``callable(epoch)``: per event in epoch mode, the final sparsity in
            step mode without ``target_sparsity``. Default: 0.5.
        apply_pruning: bool or ``callable(epoch) -> bool`` (epoch mode). Default: ``True``.
        make_pruning_permanent: drop the masks at the end of training. Default: ``True``.
        use_lottery_ticket_hypothesis: bool or ``callable(epoch)``: rewind to the fit-start values. Default: ``False``.
        resample_parameters: rewind to freshly initialised values instead. Default: ``False``.
        pruning_dim: dim whose slices structured methods prune; ``None`` = each module's output dim. Default: ``None``.
        pruning_norm: ``p`` of ``ln_structured``, > 0; ``None`` = 1. Default: ``None``.
        verbose: 0, 1 or 2. Default: 0.
        prune_on_train_epoch_end: epoch mode prunes at train (else validation) epoch end. Default: ``True``.
        schedule: ``"constant"``, ``"linear"``, ``"cubic"``, ``"exponential"`` or ``callable(step)``. Default: ``None``.
        target_sparsity: final sparsity in step mode. Default: ``None``.
        start_step, end_step, frequency: the step window and period; ``end_step=None`` = the run's last step.
            Defaults: 0, ``None``, 1.
        initial_sparsity: sparsity at ``start_step``. Default: 0.0.
        method: alias of ``pruning_fn`` (consumed: held as ``pruning_fn``, then ``None``). Default: ``None``.
        n, m: keep ``n`` of every ``m`` weights (``"nm"``), ints with ``1 <= n < m``. Default: 2, 4.
        structural: physically remove the pruned channels at the end of the schedule. Default: ``False``.
        structural_ratio: fraction of channels removed, in [0, 1); ``None`` = the final sparsity. Default: ``None``.
        seed: seed of the random methods' generator. Default: 0.
        prune_embeddings: also prune embedding tables and the weights tied to them. Default: ``False``.
        prune_heads: also prune the task heads (poolers, classifiers, LM heads, the output layer: see
            :func:`~lightning_lowmem.functional.pruning.masks.head_modules`). Default: ``False``.

    Raises:
        ValueError / TypeError: one line naming the argument, the value and what is allowed.
    """

    pruning_fn: Any = "l1_unstructured"
    parameters_to_prune: Sequence[Any] = ()
    parameter_names: Sequence[str] | None = None
    use_global_unstructured: bool = True
    amount: Amount = 0.5
    apply_pruning: bool | Callable[[int], bool] = True
    make_pruning_permanent: bool = True
    use_lottery_ticket_hypothesis: bool | Callable[[int], bool] = False
    resample_parameters: bool = False
    pruning_dim: int | None = None
    pruning_norm: float | None = None
    verbose: int = 0
    prune_on_train_epoch_end: bool = True
    schedule: str | Callable[[int], float] | None = None
    target_sparsity: float | None = None
    start_step: int = 0
    end_step: int | None = None
    frequency: int = 1
    initial_sparsity: float = 0.0
    method: str | None = None
    n: int = 2
    m: int = 4
    structural: bool = False
    structural_ratio: float | None = None
    seed: int = 0
    prune_embeddings: bool = False
    prune_heads: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "pruning_fn", self._resolve_method())
        object.__setattr__(self, "method", None)
        object.__setattr__(self, "parameters_to_prune", _as_tuple(list(self.parameters_to_prune)))
        names = self.parameter_names
        if names is not None:
            if isinstance(names, str):
                raise TypeError(f"`parameter_names` must be a list of names like ['weight'], got the string {names!r}")
            object.__setattr__(self, "parameter_names", tuple(names))
            for name in self.parameter_names:
                if not isinstance(name, str) or not name:
                    raise ValueError(f"`parameter_names` entries must be parameter names like 'weight', got {name!r}")
        _schedule().check_amount(self.amount)
        for name in ("use_global_unstructured", "make_pruning_permanent", "resample_parameters"):
            check_bool(name, getattr(self, name))
        for name in ("prune_on_train_epoch_end", "structural", "prune_embeddings", "prune_heads"):
            check_bool(name, getattr(self, name))
        _check_bool_or_callable("apply_pruning", self.apply_pruning)
        _check_bool_or_callable("use_lottery_ticket_hypothesis", self.use_lottery_ticket_hypothesis)
        self._check_numbers()
        self.sparsity_schedule()  # the step window and schedule name, checked now

    def _resolve_method(self) -> Any:
        if self.method is None:
            return _schedule().method_name(self.pruning_fn)
        if self.pruning_fn not in ("l1_unstructured", self.method):
            raise ValueError(f"`method`={self.method!r} and `pruning_fn`={self.pruning_fn!r} disagree; pass only one")
        return _schedule().method_name(self.method, "method")

    def _check_numbers(self) -> None:
        n, m = self.n, self.m
        if self.pruning_fn == "nm" and (not isinstance(n, int) or not isinstance(m, int) or not 1 <= n < m):
            raise ValueError(f"`n`={n!r}, `m`={m!r}: N:M pruning needs ints with 1 <= n < m (e.g. n=2, m=4)")
        if self.verbose not in (0, 1, 2) or isinstance(self.verbose, bool):
            raise ValueError(f"`verbose`={self.verbose!r} must be 0, 1 or 2 (0 silent, 1 total sparsity, 2 per layer)")
        ratio = self.structural_ratio
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1):
            raise ValueError(f"`structural_ratio`={ratio!r} must be in [0, 1) (or None: the final sparsity)")
        dim = self.pruning_dim
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
            raise TypeError(f"`pruning_dim`={dim!r} must be an int or None (None: each module's output-channel dim)")
        norm = self.pruning_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0):
            raise ValueError(f"`pruning_norm`={norm!r} must be a number > 0 (e.g. 1, 2, float('inf')) or None (1)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"`seed`={self.seed!r} must be an int (the random methods' generator seed)")

    @property
    def step_mode(self) -> bool:
        """The sparsity follows a step schedule (``schedule`` or ``target_sparsity`` given), not the epoch rule."""
        return self.schedule is not None or self.target_sparsity is not None

    @property
    def final_sparsity(self) -> Amount:
        """``target_sparsity`` when given, else ``amount``."""
        return self.target_sparsity if self.target_sparsity is not None else self.amount

    @property
    def names(self) -> tuple[str, ...]:
        """The parameter names pruned in each module (``parameter_names`` or :data:`DEFAULT_PARAMETER_NAMES`)."""
        return tuple(self.parameter_names) if self.parameter_names is not None else DEFAULT_PARAMETER_NAMES

    @property
    def norm(self) -> float:
        """``pruning_norm``, 1 when not given."""
        return self.pruning_norm if self.pruning_norm is not None else 1

    def sparsity_schedule(self) -> PruningSchedule | None:
        """A fresh step-mode :class:`~lightning_lowmem.functional.pruning.schedule.PruningSchedule` (``"cubic"``
        when only ``target_sparsity`` is given; a run resolves ``end_step=None`` on it), or ``None`` in epoch mode.

        Example::

            >>> PruningConfig(target_sparsity=0.8, end_step=10).sparsity_schedule().sparsity_at(10)
            0.8
        """
        if not self.step_mode:
            _schedule().check_start_step(self.start_step)
            return None
        return _schedule().PruningSchedule(
            self.schedule or "cubic",
            self.final_sparsity,
            self.start_step,
            self.end_step,
            self.frequency,
            self.initial_sparsity,
        )
