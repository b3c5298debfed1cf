"""LightningCLI behind ``lowmem fit|validate|test|predict`` (and the config reading of ``lowmem estimate``): quiet
start-up logs, and a config mistake turned into one :class:`~lightning_lowmem.cli.errors.ConfigError` line."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_lowmem.cli.errors import (
    CONFIG_ERROR_TYPES,
    ConfigError,
    explain_construction_error,
    explain_parse_error,
    init_arg_names,
    strategy_hint,
)

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


class _DropMessages(logging.Filter):
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
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(pattern))


# ----------------------------------------------------------------------------- LightningCLI
def _debug() -> bool:
    return os.environ.get("LOWMEM_DEBUG", "") not in ("", "0")


def _option_names() -> list[str]:
    """Top-level and ``trainer.*`` keys, for "did you mean" on an unknown option."""
    import lightning as L

    top = ["model", "data", "trainer", "optimizer", "lr_scheduler", "ckpt_path", "seed_everything", "config"]
    return top + [f"trainer.{name}" for name in init_arg_names(L.Trainer)]


def _root_cause(error: BaseException) -> BaseException:
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


def _constructed_class(error: BaseException) -> type | None:
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


def _import_callbacks() -> None:
    """Import every public callback class: jsonargparse resolves a short class name (``--trainer.callbacks+=
    ScheduledPruning``) and lists the choices in ``--help`` among the ``Callback`` subclasses already imported."""
    import lightning_lowmem.callbacks as callbacks

    for name in callbacks.__all__:
        getattr(callbacks, name)


def _lightning_cli(args: list[str], run: bool = True, estimate_only: bool = False, meta_model: bool = False) -> Any:
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    _import_callbacks()

    class LowMemCLI(LightningCLI):
        """LightningCLI whose configuration mistakes raise :class:`ConfigError` (one line)."""

        def parse_arguments(self, parser: Any, args: Any) -> None:  # noqa: D102 - see LightningCLI
            self._failures: list[tuple[type, BaseException]] = []
            try:
                super().parse_arguments(parser, args)
            except argparse.ArgumentError as err:
                if _debug():
                    raise
                raise ConfigError(explain_parse_error(str(err), _option_names())) from None

        def after_instantiate_classes(self) -> None:  # noqa: D102 - see LightningCLI
            if seed_filter.held and not estimate_only:  # the config is good: now say which seed was set
                seed_logger.removeFilter(seed_filter)
                seed_logger.info(seed_filter.held)

        def before_instantiate_classes(self) -> None:  # noqa: D102 - see LightningCLI
            # appended after LightningCLI's own module/datamodule instantiators, so it sees every
            # other class built from the config (callbacks, strategies, plugins, loggers ...)
            self.parser.add_instantiator(self._construct, object, subclasses=True)

        def _construct(self, class_type: type, *args: Any, **kwargs: Any) -> Any:
            try:
                return class_type(*args, **kwargs)
            except Exception as err:
                self._failures.append((class_type, err))
                raise

        def instantiate_classes(self) -> None:  # noqa: D102 - see LightningCLI
            try:
                if not meta_model:
                    return self._instantiate()
                try:  # build the model without allocating its weights; data is read later, outside
                    with torch.device("meta"):
                        return self._instantiate()
                except Exception:  # noqa: BLE001 - some modules cannot be built on meta: build them for real
                    self._failures.clear()
                    return self._instantiate()
            except Exception as err:
                if _debug():
                    raise
                raise self._config_error(err) from None

        def _instantiate(self) -> None:
            if not estimate_only:
                return super().instantiate_classes()
            # `estimate` needs the model, the data and the callbacks: no Trainer (and no banner)
            self.config_init = self.parser.instantiate_classes(self.config)
            self.model = self.config_init.get("model")
            self.datamodule = self.config_init.get("data")
            self.trainer = None

        def _config_error(self, err: Exception) -> Exception:
            if self._failures:
                cls, cause = self._failures[0]
                if isinstance(cause, CONFIG_ERROR_TYPES):
                    return ConfigError(explain_construction_error(cls, cause))
                return err
            cause = _root_cause(err)
            if isinstance(cause, (*CONFIG_ERROR_TYPES, MisconfigurationException)):
                return ConfigError(strategy_hint(cause) or explain_construction_error(_constructed_class(cause), cause))
            return err

    # Lightning logs "Seed set to 0" before the classes are built: hold it until they are, so that a
    # config error is the only line printed
    seed_logger = logging.getLogger("lightning.fabric.utilities.seed")
    seed_filter = _DropMessages(r"^Seed set to ")
    seed_logger.addFilter(seed_filter)
    try:
        with warnings.catch_warnings():
            # `main(argv)` passes the arguments explicitly; sys.argv holds the same ones
            warnings.filterwarnings("ignore", ".*LightningCLI's args parameter is intended to run from within Python.*")
            return LowMemCLI(
                subclass_mode_model=True,
                subclass_mode_data=True,
                # LightningCLI's default (True) seeds PL_GLOBAL_SEED or else 0 with a "No seed found"
                # warning; 0 is the same seed without the warning
                seed_everything_default=True if "PL_GLOBAL_SEED" in os.environ else 0,
                save_config_kwargs={"overwrite": True},
                parser_kwargs={
                    "prog": "lowmem",
                    "exit_on_error": False,
                    **{name: {"exit_on_error": False} for name in LIGHTNING_SUBCOMMANDS},
                },
                args=args,
                run=run,
            )
    finally:
        seed_logger.removeFilter(seed_filter)


def _print_error(message: str, hint: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    print(hint, file=sys.stderr)


# ----------------------------------------------------------------------------- estimate
