"""`LowMemCLI`: the LightningCLI behind ``lowmem fit|validate|test|predict`` and the config reading of
``lowmem estimate``, whose configuration mistakes raise one :class:`~lightning_lowmem.cli.errors.ConfigError` line.

Imports Lightning: the ``lowmem`` command imports this module on first use.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from typing import Any

import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_lowmem._quiet import DropMessages
from lightning_lowmem.cli.errors import (
    CONFIG_ERROR_TYPES,
    ConfigError,
    explain_construction_error,
    explain_parse_error,
    strategy_hint,
)
from lightning_lowmem.cli.runner import (
    LIGHTNING_SUBCOMMANDS,
    SEED_LOGGER,
    constructed_class,
    debug_enabled,
    import_callbacks,
    option_names,
    root_cause,
)

__all__ = ["LowMemCLI", "lightning_cli"]


class LowMemCLI(LightningCLI):
    """LightningCLI whose configuration mistakes raise :class:`ConfigError` (one line).

    Args:
        estimate_only: build the model, the data and the callbacks, no Trainer (``lowmem estimate``).
            Default: ``False``.
        meta_model: build the model on the meta device (real weights for a module that cannot be built
            there). Default: ``False``.
        seed_filter: the filter holding Lightning's "Seed set to ..." line back until the classes are built;
            that line is logged then. Default: ``None``.
        *args, **kwargs: LightningCLI's.
    """

    def __init__(
        self,
        *args: Any,
        estimate_only: bool = False,
        meta_model: bool = False,
        seed_filter: DropMessages | None = None,
        **kwargs: Any,
    ) -> None:
        self.estimate_only = estimate_only
        self.meta_model = meta_model
        self.seed_filter = seed_filter
        self._failures: list[tuple[type, BaseException]] = []
        super().__init__(*args, **kwargs)  # parses and instantiates (LightningCLI does it in __init__)

    def before_fit(self) -> None:  # noqa: D102 - see LightningCLI
        self._check_checkpoint("fit")

    def before_validate(self) -> None:  # noqa: D102 - see LightningCLI
        self._check_checkpoint("validate")

    def before_test(self) -> None:  # noqa: D102 - see LightningCLI
        self._check_checkpoint("test")

    def before_predict(self) -> None:  # noqa: D102 - see LightningCLI
        self._check_checkpoint("predict")

    def _check_checkpoint(self, subcommand: str) -> None:
        """``--ckpt_path`` against this run's callbacks, strategy and plugins, before Lightning loads anything:
        e.g. an adapters-only checkpoint without ``LowRankAdapters`` is one line naming it with its ``r``,
        whichever callbacks are configured (Lightning's own loading would list every missing base weight)."""
        ckpt_path = (self.config_init.get(subcommand) or {}).get("ckpt_path")
        if not ckpt_path:
            return
        from lightning_lowmem.checkpoints.reading import read_records
        from lightning_lowmem.checkpoints.records import KEY, CheckpointMismatchError, check, trainer_readers

        written = read_records(ckpt_path)
        try:
            check({KEY: {"writers": written}}, trainer_readers(self.trainer), stage=subcommand)
        except CheckpointMismatchError as err:
            if debug_enabled():
                raise
            raise ConfigError(f"--ckpt_path {ckpt_path}: {err}") from None

    def parse_arguments(self, parser: Any, args: Any) -> None:  # noqa: D102 - see LightningCLI
        self._failures = []
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as err:
            if debug_enabled():
                raise
            raise ConfigError(explain_parse_error(str(err), option_names())) from None

    def after_instantiate_classes(self) -> None:  # noqa: D102 - see LightningCLI
        held = self.seed_filter.held if self.seed_filter is not None else None
        if held and not self.estimate_only:  # the config is good: now say which seed was set
            seed_logger = logging.getLogger(SEED_LOGGER)
            seed_logger.removeFilter(self.seed_filter)
            seed_logger.info(held)

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
            if not self.meta_model:
                return self._instantiate()
            try:  # build the model without allocating its weights; data is read later, outside
                with torch.device("meta"):
                    return self._instantiate()
            except Exception:  # noqa: BLE001 - some modules cannot be built on meta: build them for real
                self._failures.clear()
                return self._instantiate()
        except Exception as err:
            if debug_enabled():
                raise
            raise self._config_error(err) from None

    def _instantiate(self) -> None:
        if not self.estimate_only:
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
        cause = root_cause(err)
        if isinstance(cause, (*CONFIG_ERROR_TYPES, MisconfigurationException)):
            return ConfigError(strategy_hint(cause) or explain_construction_error(constructed_class(cause), cause))
        return err


def lightning_cli(args: list[str], run: bool = True, estimate_only: bool = False, meta_model: bool = False) -> Any:
    """Run (or, with ``run=False``, only build) :class:`~lightning_lowmem.cli.lightning_cli.LowMemCLI` on ``args``.

    ``estimate_only``: build the model, the data and the callbacks, no Trainer; ``meta_model``: build the model
    on the meta device (falls back to real weights for a module that cannot be built there).
    """
    import_callbacks()
    # Lightning logs "Seed set to 0" before the classes are built: hold it until they are, so that a
    # config error is the only line printed
    seed_logger = logging.getLogger(SEED_LOGGER)
    seed_filter = DropMessages(r"^Seed set to ")
    seed_logger.addFilter(seed_filter)
    try:
        with warnings.catch_warnings():
            # `main(argv)` passes the arguments explicitly; sys.argv holds the same ones
            warnings.filterwarnings("ignore", ".*LightningCLI's args parameter is intended to run from within Python.*")
            return LowMemCLI(
                estimate_only=estimate_only,
                meta_model=meta_model,
                seed_filter=seed_filter,
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
