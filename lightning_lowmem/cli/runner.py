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
