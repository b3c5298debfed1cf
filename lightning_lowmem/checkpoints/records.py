"""What wrote a checkpoint: provenance records, checked before anything of the checkpoint is applied.

Every component of this package that changes what a Lightning checkpoint holds (an optimizer swapped for
a lean one, adapters-only weights, quantized weights...) records itself in the checkpoint dict with
:func:`record`. A loading side calls :func:`check` with the *readers* it has; a recorded writer without a
reader, or whose format a reader rejects, raises :class:`CheckpointMismatchError` naming the component to
add. Files whose very bytes differ (``CompressedCheckpointIO``) carry their record in the file's first
bytes instead, so that a plain ``torch.load`` fails naming the plugin.

The record lives under ``checkpoint["lightning_lowmem"]["writers"][writer]``::

    {"format": "adamw8bit", "version": 1, "needs": "callbacks=[MemoryEfficientOptimizer('adamw8bit')]",
     "needed_for": ["fit"], ...details}

- ``format`` / ``version``: what the writer put in the checkpoint, for the reader to judge.
- ``needs``: what the loading ``Trainer`` must have, in the words a user writes (shown in the error).
- ``needed_for``: the Trainer stages that cannot do without the reader (an optimizer state matters only
  to ``fit``; adapters-only weights to every stage). Default: every stage.

A *reader* is a callable ``accept(entry) -> str | None`` (``None``: fine; a string: why not) or ``None``
(accepts every entry). In a ``Trainer`` the readers are collected by :func:`trainer_readers` from every
callback, the strategy and the CheckpointIO plugin that define ``checkpoint_reader() -> (writer, accept)``;
:func:`check_trainer` runs the check (the lowmem callbacks do so in the LightningModule's
``on_load_checkpoint``, which Lightning calls before it loads weights, callback or optimizer states).

What cannot be caught: a ``Trainer`` without any lowmem component runs no check. There, a marked
optimizer state (:func:`lightning_lowmem.functional.optimizers.state.mark_state_dict`) still fails with a
readable message, a compressed file fails in ``torch.load`` naming ``CompressedCheckpointIO`` (one line once
``lightning_lowmem`` is imported), but an adapters-only checkpoint fails in Lightning's strict weight loading
("Missing key(s) in state_dict"). ``lowmem fit|validate|test|predict --ckpt_path`` checks the file's records
against the configured callbacks first (:func:`~lightning_lowmem.checkpoints.reading.read_records`), whatever
they are.

Example::

    >>> checkpoint = {"state_dict": {}}
    >>> record(checkpoint, writer="MyCallback", format="sparse", needs="callbacks=[MyCallback()]")
    >>> check(checkpoint, {"MyCallback": None})                     # a reader is there: fine
    >>> check(checkpoint, {})
    Traceback (most recent call last):
    ...
    lightning_lowmem.checkpoints.records.CheckpointMismatchError: this checkpoint was written with MyCallback (format 'sparse', version 1), which the loading side lacks: add callbacks=[MyCallback()].
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

__all__ = [
    "KEY",
    "SHARDED_HINT",
    "CheckpointMismatchError",
    "check",
    "check_trainer",
    "guard_module_loading",
    "is_sharded_checkpoint",
    "record",
    "records",
    "reject_sharded_checkpoint",
    "trainer_readers",
    "unguard_module_loading",
]

KEY = "lightning_lowmem"
"""Top-level checkpoint key holding the records."""

Reader = Optional[Callable[[dict], Optional[str]]]


class CheckpointMismatchError(ValueError):
    """A checkpoint needs a component (callback, plugin, setting) that the loading side lacks or rejects."""


def record(
    checkpoint: dict[str, Any],
    *,
    writer: str,
    format: str,
    version: int = 1,
    needs: str | None = None,
    needed_for: Iterable[str] | None = None,
    **details: Any,
) -> None:
    """Record in ``checkpoint`` that ``writer`` put ``format`` (``version``) in it.

    Args:
        checkpoint: the dict being saved (e.g. in a callback's ``on_save_checkpoint``).
        writer: the component's name, e.g. ``"MemoryEfficientOptimizer"``; one record per writer.
        format: what it wrote (an optimizer name, ``"adapters-only"``...).
        version: the format's version, for readers to refuse newer ones. Default: 1.
        needs: what the loading side must have, as the user would write it. Default: ``writer``.
        needed_for: Trainer stages (``"fit"``, ``"validate"``...) that need the reader. Default: all.
        **details: further plain values (weights-only loadable) the reader may use.

    Raises:
        TypeError: ``writer`` or ``format`` is not a non-empty string.
    """
    for name, value in (("writer", writer), ("format", format)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"`{name}` must be a non-empty string, got {value!r}")
    entry = {"format": format, "version": int(version), "needs": needs or writer, **details}
    if needed_for is not None:
        entry["needed_for"] = sorted(needed_for)
    checkpoint.setdefault(KEY, {}).setdefault("writers", {})[writer] = entry


def records(checkpoint: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The records of ``checkpoint``: writer -> entry (empty for checkpoints without any)."""
    section = checkpoint.get(KEY) if isinstance(checkpoint, Mapping) else None
    writers = section.get("writers") if isinstance(section, Mapping) else None
    return dict(writers) if isinstance(writers, Mapping) else {}


def check(checkpoint: Mapping[str, Any], readers: Mapping[str, Reader], *, stage: str | None = None) -> None:
    """Raise unless every writer recorded in ``checkpoint`` has a reader that accepts its entry.

    Args:
        checkpoint: a loaded checkpoint dict.
        readers: writer name -> ``accept(entry) -> str | None`` or ``None`` (accepts all).
        stage: the stage loading it (``"fit"``, ``"validate"``...); records whose ``needed_for`` excludes it
            are skipped. Default: ``None`` (check every record).

    Raises:
        CheckpointMismatchError: listing each missing or rejecting reader, with what to add.
    """
    problems = []
    for writer, entry in records(checkpoint).items():
        needed_for = entry.get("needed_for")
        if stage is not None and needed_for is not None and stage not in needed_for:
            continue
        described = f"{writer} (format {entry.get('format')!r}, version {entry.get('version')})"
        if writer not in readers:
            problems.append(
                f"this checkpoint was written with {described}, which the loading side lacks: add {entry.get('needs')}."
            )
            continue
        accept = readers[writer]
        reason = accept(entry) if accept is not None else None
        if reason:
            problems.append(f"this checkpoint was written with {described}: {reason}")
    if problems:
        raise CheckpointMismatchError(" ".join(problems))


def trainer_readers(trainer: Any) -> dict[str, Reader]:
    """Readers of every component of ``trainer`` that defines ``checkpoint_reader() -> (writer, accept)``:
    its callbacks, its strategy and the strategy's CheckpointIO plugin."""
    strategy = getattr(trainer, "strategy", None)
    components = [*getattr(trainer, "callbacks", []), strategy, getattr(strategy, "checkpoint_io", None)]
    readers: dict[str, Reader] = {}
    for component in components:
        reader = getattr(component, "checkpoint_reader", None)
        if callable(reader):
            found = reader()
            if found is not None:
                readers[found[0]] = found[1]
    return readers


def check_trainer(trainer: Any, checkpoint: Mapping[str, Any]) -> None:
    """:func:`check` ``checkpoint`` against the readers of ``trainer`` for the stage it runs.

    Raises:
        CheckpointMismatchError: see :func:`check`.
    """
    state = getattr(trainer, "state", None)
    stage = getattr(getattr(state, "fn", None), "value", None)
    check(checkpoint, trainer_readers(trainer), stage=stage)


def guard_module_loading(trainer: Any, module: Any) -> None:
    """Run :func:`check_trainer` first in ``module.on_load_checkpoint`` (idempotent; undo with
    :func:`unguard_module_loading`). Lightning calls that hook before it applies anything of a checkpoint."""
    _reject_unreadable_folder(trainer)
    installed = module.__dict__.get("on_load_checkpoint")
    if getattr(installed, "_lowmem_guard", False):
        installed._lowmem_trainer = trainer  # type: ignore[union-attr]  # the Trainer of this run
        return
    original = module.on_load_checkpoint

    def on_load_checkpoint(checkpoint: dict[str, Any]) -> Any:
        check_trainer(on_load_checkpoint._lowmem_trainer, checkpoint)  # type: ignore[attr-defined]
        return original(checkpoint)

    on_load_checkpoint._lowmem_guard = True  # type: ignore[attr-defined]
    on_load_checkpoint._lowmem_trainer = trainer  # type: ignore[attr-defined]
    module.on_load_checkpoint = on_load_checkpoint


SHARDED_HINT = (
    "load it with strategy='lowmem_fsdp' (any number of processes), or consolidate it into one file first: "
    'python -c "from lightning_lowmem.checkpoints import consolidate_checkpoint; '
    "consolidate_checkpoint('{path}', '{path}.consolidated.ckpt')\" (a Lightning checkpoint: weights, optimizer "
    "state keyed as a plain optimizer's, loops; torch's "
    "torch.distributed.checkpoint.format_utils.dcp_to_torch_save('{path}', 'out.pt') gives the raw nested dict)"
)


def is_sharded_checkpoint(path: Any) -> bool:
    """True when ``path`` is a folder written by ``torch.distributed.checkpoint`` (holds ``.metadata``)."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def reject_sharded_checkpoint(path: Any, strategy: str) -> None:
    """Raise a ``ValueError`` saying how to consolidate, if ``path`` is a sharded FSDP checkpoint."""
    if path is not None and is_sharded_checkpoint(path):
        raise ValueError(
            f"`ckpt_path`={str(path)!r} is a sharded FSDP checkpoint (a folder of per-rank shards written by "
            f"LowMemoryFSDPStrategy(save_distributed_checkpoint=True)), which {strategy} cannot read: "
            + SHARDED_HINT.format(path=path)
        )


def _reject_unreadable_folder(trainer: Any) -> None:
    """Before a strategy that reads single files loads ``ckpt_path``: a sharded FSDP folder is an error saying
    how to consolidate (Lightning's own strategies would fail in ``torch.load`` with ``IsADirectoryError``).
    The path is known only when the strategy loads, so its ``load_checkpoint`` is wrapped (idempotent)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    strategy = getattr(trainer, "strategy", None)
    if strategy is None or isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):  # these read folders
        return
    load = strategy.load_checkpoint
    if getattr(load, "_lowmem_folder_check", False):
        return

    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        reject_sharded_checkpoint(checkpoint_path, f"strategy {type(strategy).__name__}")
        return load(checkpoint_path, *args, **kwargs)

    load_checkpoint._lowmem_folder_check = True  # type: ignore[attr-defined]
    strategy.load_checkpoint = load_checkpoint


def unguard_module_loading(module: Any) -> None:
    """Remove :func:`guard_module_loading`'s wrapper from ``module``."""
    if getattr(module.__dict__.get("on_load_checkpoint"), "_lowmem_guard", False):
        del module.__dict__["on_load_checkpoint"]
