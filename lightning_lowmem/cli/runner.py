"""LightningCLI behind ``lowmem fit|validate|test|predict`` (and the config reading of ``lowmem estimate``): quiet
start-up logs, and a config mistake turned into one :class:`~lightning_lowmem.cli.errors.ConfigError` line.

The CLI class itself and :func:`~lightning_lowmem.cli.lowmem_cli.lightning_cli` are in
:mod:`~lightning_lowmem.cli.lowmem_cli` (imported on first use: it imports Lightning); this module holds what
they and ``lowmem estimate`` share, without importing Lightning."""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from pathlib import Path

import torch

from lightning_lowmem.cli.errors import init_arg_names

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")
SEED_LOGGER = "lightning.fabric.utilities.seed"


class DropMessages(logging.Filter):
    """Drops log records whose message matches one of ``patterns`` (nothing else); keeps the last one
    dropped in ``held``."""

    def __init__(self, *patterns: str) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]
        self.held: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(p.search(message) for p in self.patterns):
            self.held = message
            return False
        return True


# torchao's import logs a warning per CUDA-only kernel library that cannot load (`Failed to load
# .../torchao/_C_mxfp8...so`) and registers enums as pytree constants, which torch >= 2.13 logs as
# deprecated. Neither says anything to a `lowmem` user; each filter drops exactly those lines.
_NOISE = {
    "torchao": r"^Failed to load \S*torchao/_C\w*\.\S*so: Could not load this library",
    "torch.utils._pytree": r"is an Enum subclass and is now natively supported by torch\.compile",
}


def quiet_startup_logs() -> None:
    """Silence torchao's import-time log lines (see ``_NOISE``); idempotent.

    The CUDA-kernel line is kept on a machine with CUDA, where a kernel that does not load matters.
    """
    for name, pattern in _NOISE.items():
        if name == "torchao" and torch.cuda.is_available():
            continue
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(pattern))


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
    """Import every public callback class: jsonargparse resolves a short class name (``--trainer.callbacks+=
    ScheduledPruning``) and lists the choices in ``--help`` among the ``Callback`` subclasses already imported."""
    import lightning_lowmem.callbacks as callbacks

    for name in callbacks.__all__:
        getattr(callbacks, name)


def print_error(message: str, hint: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    print(hint, file=sys.stderr)


# ----------------------------------------------------------------------------- estimate
