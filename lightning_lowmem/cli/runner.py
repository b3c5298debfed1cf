"""LightningCLI behind ``lowmem fit|validate|test|predict`` (and the config reading of ``lowmem estimate``): a config
mistake turned into one :class:`~lightning_lowmem.cli.errors.ConfigError` line.

The CLI class itself and :func:`~lightning_lowmem.cli.lowmem_cli.lightning_cli` are in
:mod:`~lightning_lowmem.cli.lowmem_cli` (imported on first use: it imports Lightning); this module holds what
they and ``lowmem estimate`` share, without importing Lightning. The start-up log filters are
:mod:`lightning_lowmem._quiet`'s (``import lightning_lowmem`` installs them)."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any


from lightning_lowmem.cli.errors import init_arg_names

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")
SEED_LOGGER = "lightning.fabric.utilities.seed"


# ----------------------------------------------------------------------------- LightningCLI
def debug_enabled() -> bool:
    """``LOWMEM_DEBUG`` is set (not ``0``): show full tracebacks instead of one-line errors."""
    return os.environ.get("LOWMEM_DEBUG", "") not in ("", "0")


def option_names() -> list[str]:
    """Top-level and ``trainer.*`` keys, for "did you mean" on an unknown option."""
    import lightning as L

    top = ["model", "data", "trainer", "optimizer", "lr_scheduler", "ckpt_path", "seed_everything", "config"]
    return top + [f"trainer.{name}" for name in init_arg_names(L.Trainer)]


def root_cause(error: BaseException) -> BaseException:
    """The deepest exception of the chain raised outside jsonargparse (the constructor's own)."""
    import jsonargparse

    inside = str(Path(jsonargparse.__file__).parent)
    chain, seen = [error], {id(error)}
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and id(nxt) not in seen:
        chain.append(nxt)
        seen.add(id(nxt))
    for candidate in reversed(chain):
        frames = traceback.extract_tb(candidate.__traceback__)
        if frames and not frames[-1].filename.startswith(inside):
            return candidate
    return error


def constructed_class(error: BaseException) -> type | None:
    """The class whose ``__init__`` raised ``error`` (outermost such frame outside the CLI machinery)."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "__init__" and "self" in frame.f_locals:
            module = frame.f_globals.get("__name__", "")
            if not module.startswith(("jsonargparse", "lightning.pytorch.cli")):
                return type(frame.f_locals["self"])
        tb = tb.tb_next
    return None


def import_callbacks() -> None:
    """Import every public callback class, and our LightningModules / DataModules (``DistillationModule``, the
    demo's and the Hugging Face wrappers): jsonargparse resolves a short class name (``--trainer.callbacks+=
    ScheduledPruning``) and lists the choices in ``--help`` among the subclasses already imported."""
    import lightning_lowmem.callbacks as callbacks
    import lightning_lowmem.demo as demo
    from lightning_lowmem.distillation import DistillationModule  # noqa: F401 - imported to be listed

    for package in (callbacks, demo):
        for name in package.__all__:
            getattr(package, name)


def print_error(message: str, hint: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    print(hint, file=sys.stderr)


# ----------------------------------------------------------------------------- estimate


# ----------------------------------------------------------------------------- a run that fails in setup
HELD_LOGGERS = ("lightning.pytorch", "lightning.fabric")
"""Lightning's loggers: their INFO lines (``GPU available: ...``, ``Seed set to 0``, the model summary, tips) are held
back until the run's first batch, so a mistake found in setup prints only its own line."""

QUIET_WARNINGS = (r".*`tensorboardX` has been removed as a dependency.*",)
"""Lightning warnings that say nothing about the user's run (``logger=True`` without TensorBoard installed)."""

SETUP_ERROR_TYPES: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    RuntimeError,
    NotImplementedError,
    ImportError,
)
"""What our own checks raise (each with the value given and what to do): one line when raised before the first step."""

LOGGER_START_FILES = ("config.yaml", "hparams.yaml", "metrics.csv")
"""What a logger (and LightningCLI's config saving) writes into ``version_N`` when a run starts; TensorBoard's
``events.out.tfevents.*`` too."""


class HeldLines:
    """Holds Lightning's INFO log lines (not its warnings) until :meth:`release`; :meth:`drop` forgets them.

    Installed as a filter on each handler of :data:`HELD_LOGGERS` (a logger's own filters do not see its children's
    records). Idempotent to release or drop twice.
    """

    def __init__(self) -> None:
        import logging

        self.records: list[tuple[Any, Any]] = []
        self.handlers: list[Any] = []
        self._filter = logging.Filter()
        self._filter.filter = self._hold  # type: ignore[method-assign]
        for name in HELD_LOGGERS:
            for handler in logging.getLogger(name).handlers:
                handler.addFilter(self._filter)
                self.handlers.append(handler)

    def _hold(self, record: Any) -> bool:
        import logging

        if record.levelno >= logging.WARNING:
            return True
        handler = next((h for h in self.handlers if h.level <= record.levelno), None)
        self.records.append((handler, record))
        return False

    def _remove(self) -> None:
        for handler in self.handlers:
            handler.removeFilter(self._filter)
        self.handlers = []

    def release(self) -> None:
        """Print what was held (in order) and stop holding."""
        handlers, records = self.handlers, self.records
        self._remove()
        self.records = []
        emitted: set[int] = set()
        for handler, record in records:
            if handler is not None and handler in handlers and id(record) not in emitted:
                emitted.add(id(record))
                handler.handle(record)

    def drop(self) -> None:
        """Forget what was held and stop holding."""
        self._remove()
        self.records = []


def raised_by_our_check(error: BaseException) -> bool:
    """``error`` was raised by a ``raise`` statement of this package (a check with its own message), as one of
    :data:`SETUP_ERROR_TYPES`; an error raised inside torch or Lightning, or any other type, is unexpected."""
    import lightning_lowmem

    if not isinstance(error, SETUP_ERROR_TYPES):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    package = str(Path(lightning_lowmem.__file__).parent)
    last = frames[-1]
    return last.filename.startswith(package) and (last.line or "").lstrip().startswith("raise")


def remove_leftover_log_dir(log_dir: str | None, remove_empty_parent: bool = False) -> bool:
    """Remove ``log_dir`` (a failed run's ``version_N``) when it holds only what a logger writes when a run starts
    (:data:`LOGGER_START_FILES`, TensorBoard event files, an empty ``checkpoints`` folder); ``True`` if removed.
    ``remove_empty_parent``: also its parent (``lightning_logs``, created by this run) when nothing else is in it."""
    import shutil

    if not log_dir or not os.path.isdir(log_dir):
        return False
    for root, folders, files in os.walk(log_dir):
        if root != log_dir and (os.path.relpath(root, log_dir) != "checkpoints" or files or folders):
            return False
        if root == log_dir and any(folder != "checkpoints" for folder in folders):
            return False
        for name in files if root == log_dir else []:
            if name not in LOGGER_START_FILES and not name.startswith("events.out.tfevents"):
                return False
    shutil.rmtree(log_dir, ignore_errors=True)
    parent = os.path.dirname(log_dir)
    if remove_empty_parent and os.path.isdir(parent) and not os.listdir(parent):
        os.rmdir(parent)
    return True
