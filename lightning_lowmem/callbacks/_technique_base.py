"""What every technique callback shares: it says what it is, and the lifecycle around its change.

*What it is*: :attr:`TechniqueCallback.technique` (the registry field of the config it trains with,
``self.config``: what ``lowmem estimate`` and the planner read), :attr:`~TechniqueCallback.changes_step` (it
changes the training step itself, not only the module), and :meth:`~TechniqueCallback.composition_technique`
(how :mod:`lightning_lowmem.composition` names it and what it does, its tags), the refusals it brings
(:attr:`~TechniqueCallback.rules`) and whether others apply it first (:attr:`~TechniqueCallback.applies_first`).
Nothing recognises a callback by its class name.

*The lifecycle*: ``setup`` checks that every technique of the Trainer composes
(:func:`~lightning_lowmem.composition.check_composition`), joins the fit's setup transaction
(:mod:`lightning_lowmem.transaction`) and calls :meth:`~TechniqueCallback.setup_technique`;
:meth:`~TechniqueCallback.apply_config` applies the config with :func:`lightning_lowmem.functional.apply` and
records its undo in the transaction; ``on_exception`` rolls the transaction back (a failure before training:
every callback's and the strategy's change undone, last first) and, for the callbacks that give the model back
when fit fails, tears down; ``teardown`` calls :meth:`~TechniqueCallback.release` (hooks, wrappers) and undoes
the applied config unless the change is the result (:attr:`~TechniqueCallback.undo_on_teardown`);
``load_state_dict`` keeps the checkpoint's state for :meth:`~TechniqueCallback.warn_if_restored_differs`.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, ClassVar

import lightning as L
from typing_extensions import override

from lightning_lowmem.composition import Rule, Technique, check_composition
from lightning_lowmem.functional.applied import Applied, apply
from lightning_lowmem.transaction import Transaction, commit, join, rollback
from lightning_lowmem.warnings import LowMemWarning

__all__ = ["TechniqueCallback"]


class TechniqueCallback(L.Callback):
    """Base of the technique callbacks (not for direct use).

    Subclasses set the class attributes, build ``self.config`` in ``__init__``, and override
    :meth:`setup_technique` / :meth:`release` (and Lightning's other hooks) for what is their own.
    """

    #: the registry field (``TrainingConfig`` keyword) of ``self.config``, the technique this callback trains
    #: with; ``None`` when it trains with none (it acts after training, or only measures)
    technique: ClassVar[str | None] = None
    #: it changes the training step (its order, its loss, the optimizer step), not only the module
    changes_step: ClassVar[bool] = False
    #: what it does, for :data:`lightning_lowmem.composition.RULES` (see :meth:`composition_tags`)
    tags: ClassVar[frozenset[str]] = frozenset()
    #: the composition rules this callback brings (pairs with it that are refused), checked beside ``RULES``
    rules: ClassVar[tuple[Rule, ...]] = ()
    #: its change must be in place before another callback chooses layers (``LowRankAdapters``), whatever the
    #: callbacks' order: that callback applies this one's config first (its handler gives the same result twice)
    applies_first: ClassVar[bool] = False
    #: ``teardown`` undoes the applied config (``False``: the change is the fit's result, e.g. LoRA's adapters)
    undo_on_teardown: ClassVar[bool] = True
    #: a fit that fails after training started gives the model back as it came (``teardown`` on ``on_exception``)
    undo_on_exception: ClassVar[bool] = False

    config: Any = None
    _applied: Applied | None = None
    _restored: dict[str, Any] | None = None
    _transaction: Transaction | None = None

    # --- what it is ----------------------------------------------------------------------------------------

    def composition_label(self) -> str:
        """How a refusal names this callback, as the user wrote it (default: its class name)."""
        return type(self).__name__

    def composition_tags(self) -> frozenset[str]:
        """What it does, for the composition rules (default: :attr:`tags`)."""
        return self.tags

    def composition_technique(self) -> Technique:
        """This callback for :func:`~lightning_lowmem.composition.check_composition`."""
        return Technique(
            self.composition_label(), self.composition_tags(), optimizer=self.composition_optimizer(), rules=self.rules
        )

    def composition_optimizer(self) -> str | None:
        """The optimizer's name, for an optimizer technique (default: ``None``)."""
        return None

    # --- the lifecycle ---------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_composition(trainer, stage)  # every pair of switches composes, or none is applied
        self._transaction = join(trainer) if stage == "fit" else None
        self.on_rollback(lambda: self.release(trainer, pl_module))
        self.setup_technique(trainer, pl_module, stage)

    def setup_technique(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Override point: this callback's part of ``setup`` (after the composition check)."""

    def on_rollback(self, undo: Callable[[], Any]) -> None:
        """Record how to give back a change made before training starts (undone if the fit fails before it)."""
        if self._transaction is not None:
            self._transaction.on_undo(undo)

    def apply_config(self, pl_module: L.LightningModule, config: Any = None, **kwargs: Any) -> Applied:
        """Apply ``config`` (default: ``self.config``) with :func:`~lightning_lowmem.functional.apply`; its undo
        joins the setup transaction."""
        self._applied = apply(pl_module, self.config if config is None else config, **kwargs)
        self.on_rollback(self.undo_applied)
        return self._applied

    def undo_applied(self) -> None:
        """Give back what :meth:`apply_config` changed (nothing when nothing is applied)."""
        if self._applied is not None:
            self._applied.undo()
            self._applied = None

    def release(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Override point: release hooks / wrappers this callback holds (``teardown``, and a failed setup)."""

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        commit(trainer)  # training starts: the setup's changes stay

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        rollback(trainer)  # failed before training: every change of this fit undone, last first
        if self.undo_on_exception:  # Lightning calls no `teardown` when fit raises
            self.teardown(trainer, pl_module, "fit")

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        commit(trainer)  # a fit that ended without training (max_steps=0) keeps its changes too
        self.release(trainer, pl_module)
        if self.undo_on_teardown:
            self.undo_applied()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)  # compared once the technique is applied again

    def warn_if_restored_differs(self, key: str, current: Any, message: str, default: Any = None) -> None:
        """Warn (:class:`LowMemWarning`) when the checkpoint this fit resumed recorded another ``key`` than
        ``current``; ``message`` is formatted with ``restored`` and ``current``."""
        if self._restored is None:
            return
        restored = self._restored.get(key, default)
        if restored is not None and restored != current:
            text = message.format(restored=restored, current=current)
            warnings.warn(f"{type(self).__name__}: {text}", LowMemWarning, stacklevel=3)
