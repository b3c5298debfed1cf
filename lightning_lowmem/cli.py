"""The ``lowmem`` command: LightningCLI's ``fit|validate|test|predict`` plus ``estimate`` and ``demo``.

Examples::

    lowmem fit --config examples/configs/pruning.yaml
    lowmem estimate --config examples/configs/full_stack.yaml --budget 8GiB
    lowmem demo --quick

A mistake in a config (an unknown class path or argument, a value a constructor rejects) is reported as
one ``error:`` line on stderr with exit code 2; ``LOWMEM_DEBUG=1`` shows the full traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_lowmem._cli_errors import (
    CONFIG_ERROR_TYPES,
    ConfigError,
    did_you_mean,
    explain_construction_error,
    explain_parse_error,
    init_arg_names,
    strategy_hint,
)

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")
SUBCOMMANDS = {
    "fit": "train a model: --config x.yaml, or --model / --data / --trainer.* options (LightningCLI)",
    "validate": "run the validation loop once (LightningCLI)",
    "test": "run the test loop once (LightningCLI)",
    "predict": "run prediction (LightningCLI)",
    "estimate": "predict a training step's peak memory without allocating it; --budget plans a mix that fits",
    "demo": "baseline vs the low-memory stack on the embedded workloads (--quick: about one minute)",
}
OVERVIEW = """usage: lowmem {fit,validate,test,predict,estimate,demo} [options]

Memory-saving training for PyTorch Lightning: LightningCLI plus `estimate` and `demo`.

subcommands:
%s

Run `lowmem <subcommand> --help` for its options. Examples:
  lowmem fit --config examples/configs/full_stack.yaml
  lowmem estimate --config examples/configs/full_stack.yaml --budget 8GiB
  lowmem demo --quick"""

ESTIMATE_USAGE = """usage: lowmem estimate [--budget SIZE] [--device {cuda,cpu}] [--batch-shape SPEC] [--json]
                       [--real-weights] [--fine-tune] [--devices N --strategy {ddp,zero1,fsdp}]
                       (--config CONFIG.yaml | --model CLASS_PATH [--data CLASS_PATH]) [...]

Predict the peak memory of one training step without allocating it, and (with --budget) plan the
cheapest technique mix that fits. Takes the same model / data / trainer options as `lowmem fit`; the
precision and the memory callbacks of the config (ActivationCheckpointing, ActivationCompression,
MemoryEfficientOptimizer, LowRankAdapters) are what is estimated.

options:
  --budget SIZE       plan for this memory, e.g. 8GiB or 512MB (default: the config's
                      LowMemoryStrategy memory_budget, if any). The search is shown on stderr.
  --device DEVICE     cuda or cpu (default: cuda when this machine has one, else cpu)
  --batch-shape SPEC  the batch to estimate, instead of taking one from --data. Tensors are
                      comma-separated shapes, integer (int64) unless a dtype is given:
                        32x64,32x64                    a tuple (inputs, targets) of token ids
                        64x1x8x8:float32,64            float images and int labels
                        input_ids=4x128,attention_mask=4x128,labels=4x128
                                                       a dict batch (Hugging Face models)
  --json              machine-readable output
  --real-weights      build the model for real (default: on the meta device, no weight memory)
  --fine-tune         also plan LoRA / QLoRA candidates
  --devices N         processes (GPUs) the step runs on; the batch is one process's batch
  --strategy NAME     ddp, zero1 (lowmem_ddp + zero_optimizer) or fsdp (lowmem_fsdp): per-rank
                      peaks, without the devices"""


# ----------------------------------------------------------------------------- startup noise
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


def _lightning_cli(args: list[str], run: bool = True, estimate_only: bool = False, meta_model: bool = False) -> Any:
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

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
_DTYPES = {
    "long": torch.int64, "int64": torch.int64, "int": torch.int64, "int32": torch.int32, "bool": torch.bool,
    "float": torch.float32, "float32": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip


def parse_batch_shape(spec: str) -> Any:
    """A batch of ``meta`` tensors from a ``--batch-shape`` spec (see ``lowmem estimate --help``).

    Example::

        >>> batch = parse_batch_shape("input_ids=4x128,labels=4x128")
        >>> {k: tuple(v.shape) for k, v in batch.items()}
        {'input_ids': (4, 128), 'labels': (4, 128)}
        >>> [(tuple(t.shape), t.dtype) for t in parse_batch_shape("8x1x8x8:float32,8")]
        [((8, 1, 8, 8), torch.float32), ((8,), torch.int64)]
    """
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"--batch-shape {spec!r} is empty; e.g. 32x64,32x64 or input_ids=4x128,labels=4x128")
    named = ["=" in item for item in items]
    if any(named) and not all(named):
        raise ConfigError(f"--batch-shape {spec!r} mixes named (key=shape) and unnamed tensors; use one form")
    tensors: list[tuple[str | None, torch.Tensor]] = []
    for item in items:
        key, _, shape_dtype = item.rpartition("=")
        shape, _, dtype_name = shape_dtype.partition(":")
        dtype = _DTYPES.get(dtype_name.strip().lower() or "int64")
        if dtype is None:
            raise ConfigError(
                f"--batch-shape: dtype {dtype_name!r} in {item!r} is unknown{did_you_mean(dtype_name, _DTYPES)}; "
                f"choose one of {', '.join(_DTYPES)}"
            )
        try:
            dims = [int(d) for d in shape.lower().split("x")]
        except ValueError:
            dims = []
        if not dims or any(d <= 0 for d in dims):
            raise ConfigError(f"--batch-shape: {shape!r} in {item!r} is not a shape like 32x64 (positive sizes joined by x)")
        tensors.append((key or None, torch.empty(dims, dtype=dtype, device="meta")))
    if all(named):
        return {key: tensor for key, tensor in tensors}
    return tensors[0][1] if len(tensors) == 1 else tuple(tensor for _, tensor in tensors)


def _first_batch(datamodule: Any) -> Any:
    datamodule.prepare_data()
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def configured_techniques(cli: Any) -> dict[str, Any]:
    """:class:`~lightning_lowmem.functional.config.TrainingConfig` arguments for what the config turns on: the
    trainer's precision, the model's optimizer name and the memory callbacks' / strategy's configs (plus
    ``memory_budget``). Unknown callbacks add nothing."""
    from lightning_lowmem.functional.optimizers.registry import available_optimizers

    trainer_config = cli.config.get("trainer") or {}
    precision = str(trainer_config.get("precision") or "32-true")
    found: dict[str, Any] = {"precision": {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}.get(precision, precision)}
    optimizer = getattr(getattr(cli.model, "hparams", {}), "get", lambda *_: None)("optimizer")
    if isinstance(optimizer, str) and optimizer in available_optimizers():
        found["optimizer"] = optimizer
    callbacks = (cli.config_init.get("trainer") or {}).get("callbacks") or []
    strategy = (cli.config_init.get("trainer") or {}).get("strategy")
    for item in [*(callbacks if isinstance(callbacks, list) else [callbacks]), strategy]:
        name = type(item).__name__
        config = getattr(item, "config", None)  # the callbacks' / strategies' functional.config objects
        if name == "ActivationCheckpointing":
            found["checkpointing"] = config
        elif name == "ActivationCompression":
            found["compression"] = config
        elif name == "MemoryEfficientOptimizer":
            found["optimizer"] = config
        elif name == "LowRankAdapters":
            found["lora"] = config
        elif name in ("LowMemoryStrategy", "LowMemoryDDPStrategy") and config is not None:
            for field in ("checkpointing", "compression", "optimizer"):
                if getattr(config, field) is not None:
                    found[field] = getattr(config, field)
            if getattr(item, "memory_budget", None) is not None:
                found["memory_budget"] = item.memory_budget  # what `lowmem fit` would plan for
    return {key: value for key, value in found.items() if value is not None}


def estimate_main(argv: list[str]) -> int:
    """``lowmem estimate``: Rich table of the estimate, or of the candidates and the chosen plan."""
    parser = argparse.ArgumentParser(prog="lowmem estimate", usage=ESTIMATE_USAGE, add_help=False)
    parser.add_argument("--budget", default=None)
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"])
    parser.add_argument("--batch-shape", default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--real-weights", action="store_true")
    parser.add_argument("--fine-tune", action="store_true")
    parser.add_argument("--devices", default=None)
    parser.add_argument("--strategy", default=None)
    parser.add_argument("-h", "--help", action="store_true")
    own, rest = parser.parse_known_args(argv)
    if own.help:
        print(ESTIMATE_USAGE)
        return 0
    hint = "see `lowmem estimate --help`"
    if not any(a.startswith(("--config", "--model", "-c")) for a in rest):
        _print_error(
            "lowmem estimate needs a model: give the same YAML as `lowmem fit` (--config path.yaml) or a model "
            "class, e.g. lowmem estimate --model lightning_lowmem.demo.CharLM --data "
            "lightning_lowmem.demo.CharLMDataModule --budget 8GiB",
            hint,
        )
        return 2
    try:
        batch = parse_batch_shape(own.batch_shape) if own.batch_shape else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cli = _lightning_cli(rest, run=False, estimate_only=True, meta_model=not own.real_weights)
        if batch is None and cli.datamodule is None:
            raise ConfigError(
                "lowmem estimate needs a batch: add --data CLASS_PATH (or a `data:` section) to take one from, or "
                "--batch-shape, e.g. 32x64,32x64 or input_ids=4x128,attention_mask=4x128,labels=4x128"
            )
        techniques = configured_techniques(cli)
    except ConfigError as err:
        _print_error(str(err), hint)
        return 2
    if own.devices is not None or own.strategy is not None:
        from lightning_lowmem.planning.sharding import check_sharding

        strategy = (own.strategy or "ddp").removeprefix("lowmem_")
        try:
            devices = int(own.devices) if own.devices is not None else 1
        except ValueError:
            devices = own.devices
        try:
            check_sharding(devices, strategy)
        except ValueError as err:
            _print_error(str(err).replace("`world_size`", "--devices").replace("`sharding`", "--strategy"), hint)
            return 2
        if own.budget is not None:
            _print_error("--budget plans one process; drop --devices / --strategy to plan, or --budget to estimate", hint)
            return 2
        techniques = {**techniques, "world_size": devices, "sharding": strategy}
    if batch is None:
        batch = _first_batch(cli.datamodule)
    device = own.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return _report(cli.model, batch, techniques, device, own)


def _report(model: Any, batch: Any, techniques: dict[str, Any], device: str, own: argparse.Namespace) -> int:
    from rich.console import Console

    from lightning_lowmem.memory import format_bytes
    from lightning_lowmem.planning.estimate import TrainingConfig, estimate_memory
    from lightning_lowmem.planning.plan import plan_memory
    from lightning_lowmem.planning.plan_report import rich_progress
    from lightning_lowmem.model_io import describe_batch

    console = Console()
    where = device if device == "cuda" or torch.cuda.is_available() else "cpu (no CUDA device here; --device cuda plans for a GPU)"
    budget = techniques.pop("memory_budget", None)
    own.budget = own.budget if own.budget is not None else budget
    config = TrainingConfig(**{"optimizer": None, **techniques})  # no optimizer set: configure_optimizers'
    if own.budget is None:
        report = estimate_memory(model, batch, device=device, config=config)
        if own.json:
            print(json.dumps(report.to_dict(), indent=2, default=str))
            return 0
        label = report.meta["label"]
        if "per_rank" in report.meta:
            console.print(_per_rank_table(report, f"Estimated per-rank training step on {where}: {label}"))
        else:
            console.print(report.to_table(title=f"Estimated training step on {where}: {label}"))
        console.print(f"batch: {describe_batch(batch)}", markup=False)
        return 0
    loras = [None, {"r": 8}, {"r": 8, "quantize_base": "int8"}] if own.fine_tune else None
    # techniques the config switches on stay on, as LowMemoryStrategy keeps the options it was given;
    # precision and optimizer are the baseline the search starts from
    fixed = TrainingConfig(precision=None, optimizer=None, checkpointing=config.checkpointing,
                           compression=config.compression, lora=config.lora)  # fmt: skip
    wanted: dict[str, Any] = {"precision": config.precision_preset, "optimizer": config.optimizer_name}
    if config.optimizer is not None and config.optimizer.hyperparameters:
        wanted["optimizer_kwargs"] = config.optimizer.kwargs
    # a candidate that cannot run on fake tensors is listed with its error in the plan table; torch
    # also logs the failing op's traceback, which the table already summarises
    fake_logger = logging.getLogger("torch._subclasses.fake_tensor")
    fake_filter = _DropMessages(r"^failed while attempting to run meta for ")
    fake_logger.addFilter(fake_filter)
    try:
        with rich_progress(Console(stderr=True)) as progress:
            plan = plan_memory(model, batch, own.budget, device=device, loras=loras, progress=progress, config=fixed,
                               **wanted)  # fmt: skip
    except ValueError as err:
        if own.json:
            print(json.dumps({"error": str(err)}))
        else:
            console.print(str(err), style="bold red", markup=False)
        return 1
    finally:
        fake_logger.removeFilter(fake_filter)
    if own.json:
        print(json.dumps(plan.to_dict(), indent=2, default=str))
        return 0
    console.print(plan.to_table())
    console.print(
        f"chosen: [bold]{plan.config.describe()}[/bold] -> predicted peak "
        f"{format_bytes(plan.predicted_peak_bytes)} (budget {format_bytes(plan.budget_bytes)}, device {where}; "
        f"planned in {plan.seconds:.1f} s)"
    )
    return 0


def _per_rank_table(report: Any, title: str) -> Any:
    """One row per rank: peak and breakdown (``estimate_memory(..., world_size=N, sharding=...)``)."""
    from rich.table import Table

    from lightning_lowmem.memory import format_bytes
    from lightning_lowmem.memory.report import CATEGORIES

    meta = report.meta
    table = Table(title=f"{title} | {meta['sharding']} x {meta['world_size']} processes")
    table.add_column("rank", justify="right")
    for category in CATEGORIES:
        table.add_column(category, justify="right")
    table.add_column("peak", justify="right", style="bold")
    for rank in meta["per_rank"]:
        table.add_row(str(rank["rank"]), *(format_bytes(rank["breakdown"][c]) for c in CATEGORIES),
                      format_bytes(rank["peak_bytes"]))  # fmt: skip
    for name, value in report.overheads.items():
        table.add_row(f"+ {name}", *[""] * len(CATEGORIES), format_bytes(value))
    return table


# ----------------------------------------------------------------------------- entry point
def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lowmem`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_startup_logs()
    # Lightning 2.6 on torch >= 2.13 warns about its own use of torch's pytree on every fit
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    if not argv or argv[0] in ("-h", "--help"):
        print(OVERVIEW % "\n".join(f"  {name:<9} {text}" for name, text in SUBCOMMANDS.items()))
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from lightning_lowmem import __version__

        print(f"lowmem (lightning_lowmem) {__version__}")
        return 0
    command = argv[0]
    if command == "estimate":
        return estimate_main(argv[1:])
    if command == "demo":
        from lightning_lowmem.demo.run import main as demo_main

        return demo_main(argv[1:])
    if not command.startswith("-") and command not in LIGHTNING_SUBCOMMANDS:
        _print_error(
            f"unknown subcommand {command!r}{did_you_mean(command, SUBCOMMANDS)}; choose one of {', '.join(SUBCOMMANDS)}",
            "see `lowmem --help`",
        )
        return 2
    try:
        _lightning_cli(argv)
    except ConfigError as err:
        sub = command if command in LIGHTNING_SUBCOMMANDS else "fit"
        _print_error(str(err), f"see `lowmem {sub} --help`; LOWMEM_DEBUG=1 shows the full error")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
