"""A fit's setup as one transaction: what our callbacks and strategies change before training starts is undone
together, last change first, when anything fails before the first training step (issue #34).

Lightning calls every callback's ``on_exception`` (and the strategy's) when ``setup``, ``configure_model``,
``configure_optimizers``, a checkpoint restore or ``on_fit_start`` raises, but no callback's ``teardown``; a
callback that undid only its own change would leave an earlier callback's (LoRA's wrapped, frozen model) in
place, and an undo out of order could meet a module another technique wrapped since. So each change records
its undo here, on the trainer's open transaction: the first ``on_exception`` rolls all of them back in reverse,
and ``on_train_start`` (or a ``teardown`` after a fit that did not train) commits them, after which each
technique keeps or undoes its change as it always did.

Example::

    >>> class Trainer: ...
    >>> trainer, undone = Trainer(), []
    >>> join(trainer).on_undo(lambda: undone.append("lora"))
    >>> join(trainer).on_undo(lambda: undone.append("checkpointing"))
    >>> rollback(trainer); undone
    ['checkpointing', 'lora']
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__ = ["Transaction", "commit", "join", "rollback"]


class Transaction:
    """The undos of one fit's setup, in the order the changes were made."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], Any]] = []
        self.open = True

    def on_undo(self, undo: Callable[[], Any]) -> None:
        """Record how to give back a change about to be made (ignored once the transaction is closed)."""
        if self.open:
            self._undo.append(undo)

    def rollback(self) -> None:
        """Call every recorded undo, last first; one that fails does not stop the others (the first error is
        raised after them)."""
        self.open = False
        error: BaseException | None = None
        while self._undo:
            try:
                self._undo.pop()()
            except BaseException as err:  # noqa: BLE001 - the other undos still run
                error = error or err
        if error is not None:
            raise error

    def commit(self) -> None:
        """Keep the changes: training started."""
        self.open = False
        self._undo.clear()


_OPEN: weakref.WeakKeyDictionary[Any, Transaction] = weakref.WeakKeyDictionary()


def join(trainer: Any) -> Transaction:
    """The trainer's open transaction (a new one when none is open: a new fit)."""
    transaction = _OPEN.get(trainer)
    if transaction is None or not transaction.open:
        transaction = _OPEN[trainer] = Transaction()
    return transaction


def commit(trainer: Any) -> None:
    """Close the trainer's open transaction, keeping its changes (nothing when none is open)."""
    transaction = _OPEN.pop(trainer, None)
    if transaction is not None:
        transaction.commit()


def rollback(trainer: Any) -> None:
    """Undo everything recorded in the trainer's open transaction, last change first (nothing when none is open)."""
    transaction = _OPEN.pop(trainer, None)
    if transaction is not None:
        transaction.rollback()
