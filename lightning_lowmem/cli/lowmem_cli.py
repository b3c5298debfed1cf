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
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_lowmem._quiet import DropMessages
from lightning_lowmem.cli.errors import (
    CONFIG_ERROR_TYPES,
    ConfigError,
    duplicate_callback_line,
    explain_construction_error,
    explain_parse_error,
    strategy_hint,
)
from lightning_lowmem.cli.runner import (
    LIGHTNING_SUBCOMMANDS,
    QUIET_WARNINGS,
    SEED_LOGGER,
    HeldLines,
    constructed_class,
    debug_enabled,
    import_callbacks,
    option_names,
    raised_by_our_check,
    remove_leftover_log_dir,
    root_cause,
)

__all__ = ["HFConfigModel", "LowMemCLI", "lightning_cli"]


class HFConfigModel(LightningModule):
    """The model slot of ``lowmem estimate --hf-config PATH --trainer.* ...``: the trainer options are read as
    ``lowmem fit`` reads them; the model estimated is the one the config.json describes (built elsewhere)."""


class LowMemCLI(LightningCLI):
    """LightningCLI whose configuration mistakes raise :class:`ConfigError` (one line).

    Args:
        estimate_only: build the model, the data and the callbacks, no Trainer (``lowmem estimate``).
            Default: ``False``.
        meta_model: build the model on the meta device (real weights for a module that cannot be built
            there). Default: ``False``.
        seed_filter: the filter holding Lightning's "Seed set to ..." line back until the classes are built;
            that line is logged then. Default: ``None``.
        held_lines: Lightning's INFO lines held back until the first batch (printed then; dropped when the run
            fails in setup on one of our checks, which then prints one line). Default: ``None``.
        *args, **kwargs: LightningCLI's.
    """

    def __init__(
        self,
        *args: Any,
        estimate_only: bool = False,
        meta_model: bool = False,
        seed_filter: DropMessages | None = None,
        held_lines: HeldLines | None = None,
        **kwargs: Any,
    ) -> None:
        self.estimate_only = estimate_only
        self.meta_model = meta_model
        self.seed_filter = seed_filter
        self._failures: list[tuple[type, BaseException]] = []
        self.first_step = _FirstStep()
        self.first_step.held = held_lines
        self.log_dir: tuple[str, bool] | None = None  # this run's version_N, and whether its parent existed
        LowMemCLI.running = self  # a run that fails in trainer.fit is explained from here (see lightning_cli)
        super().__init__(*args, **kwargs)  # parses and instantiates (LightningCLI does it in __init__)

    running: LowMemCLI | None = None

    def before_fit(self) -> None:  # noqa: D102 - see LightningCLI
        self._before_run("fit")

    def before_validate(self) -> None:  # noqa: D102 - see LightningCLI
        self._before_run("validate")

    def before_test(self) -> None:  # noqa: D102 - see LightningCLI
        self._before_run("test")

    def before_predict(self) -> None:  # noqa: D102 - see LightningCLI
        self._before_run("predict")

    def _before_run(self, subcommand: str) -> None:
        """The checkpoint to resume checked before Lightning starts the run, and the run's ``version_N`` folder noted
        (removed if the run fails in setup)."""
        self._check_checkpoint(subcommand)
        self.trainer.callbacks.append(self.first_step)
        logger = self.trainer.logger
        log_dir = getattr(logger, "log_dir", None) if logger is not None else None
        if log_dir and not os.path.exists(log_dir):
            self.log_dir = (str(log_dir), os.path.isdir(os.path.dirname(str(log_dir))))

    def _check_checkpoint(self, subcommand: str) -> None:
        """``--ckpt_path`` against this run's callbacks, strategy and plugins, before Lightning loads anything:
        e.g. an adapters-only checkpoint without ``LowRankAdapters`` is one line naming it with its ``r``,
        whichever callbacks are configured (Lightning's own loading would list every missing base weight)."""
        ckpt_path = (self.config_init.get(subcommand) or {}).get("ckpt_path")
        if not ckpt_path:
            return
        path = str(ckpt_path)
        if path not in ("last", "best", "hpc", "registry") and "://" not in path and not os.path.exists(path):
            raise ConfigError(
                f"--ckpt_path {path!r}: no such file or folder; give a checkpoint a fit wrote (e.g. "
                "lightning_logs/version_0/checkpoints/last.ckpt), 'last' for the newest one, or leave it out",
                hint="see `lowmem fit --help`",
            )
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
        twice = duplicate_callback_line(cause)
        return ConfigError(twice) if twice else err


class _FirstStep(Callback):
    """Prints Lightning's held INFO lines once the first batch is done (a mistake found in setup or in the first step
    prints only its own line), and notes the first training batch, to name it if that step fails."""

    def __init__(self) -> None:
        self.held: HeldLines | None = None
        self.batch: str | None = None  # the first training batch, described

    def _release(self, trainer: Any) -> None:
        if self.held is not None and not trainer.sanity_checking:
            self.held.release()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:  # noqa: D102
        if self.batch is None and trainer.global_step == 0:
            from lightning_lowmem.model_io import describe_batch

            self.batch = describe_batch(batch)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:  # noqa: D102
        self._release(trainer)

    def on_validation_batch_end(self, trainer: Any, *args: Any) -> None:  # noqa: D102
        self._release(trainer)

    def on_test_batch_end(self, trainer: Any, *args: Any) -> None:  # noqa: D102
        self._release(trainer)

    def on_predict_batch_end(self, trainer: Any, *args: Any) -> None:  # noqa: D102
        self._release(trainer)


def failed_run_line(cli: LowMemCLI | None, error: BaseException) -> str | None:
    """One line for a run that failed before its first optimizer step on a check of this package (the class of
    error, where, the check's own message: what was given and what to do), or on a first batch of the wrong dtype;
    ``None`` for anything else (it keeps its traceback)."""
    from lightning_lowmem.cli.errors import one_line

    trainer = getattr(cli, "trainer", None)
    if cli is None or trainer is None or trainer.global_step > 0:
        return None
    if raised_by_our_check(error):
        owner = _raising_component(error)
        return one_line(f"{type(error).__name__} in {owner}: {error}" if owner else f"{type(error).__name__}: {error}")
    batch = cli.first_step.batch
    if batch is not None and isinstance(error, (RuntimeError, TypeError)) and "scalar type" in str(error):
        return one_line(
            f"the first training step failed on the batch {batch}: {type(error).__name__}: {error}; check that "
            "the datamodule gives what training_step takes (token ids are int64)"
        )
    return None


def _raising_component(error: BaseException) -> str | None:
    """``ActivationCheckpointing.setup``: the outermost method of one of our callbacks / strategies / plugins in the
    traceback of ``error``."""
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        module = type(owner).__module__ if owner is not None else ""
        if module.startswith("lightning_lowmem") and not module.startswith("lightning_lowmem.cli"):
            return f"{type(owner).__name__}.{tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return None


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
    held = HeldLines() if run and not estimate_only else None
    LowMemCLI.running = None
    try:
        with warnings.catch_warnings():
            # `main(argv)` passes the arguments explicitly; sys.argv holds the same ones
            warnings.filterwarnings("ignore", ".*LightningCLI's args parameter is intended to run from within Python.*")
            for pattern in QUIET_WARNINGS:
                warnings.filterwarnings("ignore", pattern)
            cli = LowMemCLI(
                estimate_only=estimate_only,
                meta_model=meta_model,
                seed_filter=seed_filter,
                held_lines=held,
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
    except ConfigError:
        if held is not None:
            held.drop()
        raise
    except Exception as err:
        cli = LowMemCLI.running
        line = None if debug_enabled() else failed_run_line(cli, err)
        if line is None:
            if held is not None:
                held.release()
            raise
        if held is not None:
            held.drop()
        if cli is not None and cli.log_dir is not None:
            remove_leftover_log_dir(cli.log_dir[0], remove_empty_parent=not cli.log_dir[1])
        raise ConfigError(
            line, hint="the run stopped before its first step; LOWMEM_DEBUG=1 shows the traceback"
        ) from None
    finally:
        seed_logger.removeFilter(seed_filter)
        LowMemCLI.running = None
    if held is not None:
        held.release()
    return cli
