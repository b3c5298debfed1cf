"""``lowmem estimate``: a config's training step, estimated (``--budget``: planned) without allocating it."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
import warnings
from typing import Any

import torch

from lightning_lowmem.cli.errors import (
    ConfigError,
    did_you_mean,
    one_line,
)
from lightning_lowmem._quiet import DropMessages
from lightning_lowmem.cli.estimate_args import (
    ESTIMATE_USAGE,
    check_choices,
    estimate_parser,
    parse_length,
    short_flag_techniques,
)
from lightning_lowmem.cli.runner import debug_enabled, print_error

__all__ = ["ESTIMATE_USAGE", "configured_techniques", "estimate_main", "parse_batch_shape"]

# ----------------------------------------------------------------------------- batches
_DTYPES = {
    "long": torch.int64,
    "int64": torch.int64,
    "int": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
    "float": torch.float32,
    "float32": torch.float32,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


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
            raise ConfigError(
                f"--batch-shape: {shape!r} in {item!r} is not a shape like 32x64 (positive sizes joined by x)"
            )
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
    ``memory_budget``). A callback adds the config of the technique it says it trains with (its ``technique``
    field and ``config``: the technique callbacks' base); one the estimator cannot run (pruning) and unknown
    callbacks add nothing."""
    from lightning_lowmem.functional.config import TrainingConfig
    from lightning_lowmem.functional.optimizers.catalog import available_optimizers
    from lightning_lowmem.functional.registry import techniques

    estimable = {t.field for t in techniques() if t.not_estimated is None}

    trainer_config = cli.config.get("trainer") or {}
    precision = str(trainer_config.get("precision") or "32-true")
    found: dict[str, Any] = {
        "precision": {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}.get(precision, precision)
    }
    optimizer = getattr(getattr(cli.model, "hparams", {}), "get", lambda *_: None)("optimizer")
    if isinstance(optimizer, str) and optimizer in available_optimizers():
        found["optimizer"] = optimizer
    callbacks = (cli.config_init.get("trainer") or {}).get("callbacks") or []
    strategy = (cli.config_init.get("trainer") or {}).get("strategy")
    for item in [*(callbacks if isinstance(callbacks, list) else [callbacks]), strategy]:
        field = getattr(item, "technique", None)  # what a technique callback says it trains with
        config = getattr(item, "config", None)  # the callbacks' / strategies' functional.config objects
        if isinstance(field, str) and config is not None:
            if field in estimable:
                found[field] = config
        elif isinstance(config, TrainingConfig) and not getattr(item, "shards_parameters", False):
            for field in ("checkpointing", "compression", "optimizer"):
                if getattr(config, field) is not None:
                    found[field] = getattr(config, field)
            if getattr(item, "memory_budget", None) is not None:
                found["memory_budget"] = item.memory_budget  # what `lowmem fit` would plan for
    return {key: value for key, value in found.items() if value is not None}


def estimate_main(argv: list[str]) -> int:
    """``lowmem estimate``: Rich table of the estimate, or of the candidates and the chosen plan."""
    parser = estimate_parser()
    own, rest = parser.parse_known_args(argv)
    if own.help:
        print(ESTIMATE_USAGE)
        return 0
    hint = "see `lowmem estimate --help`"
    try:
        check_choices(own)
        flags = short_flag_techniques(own)
    except ConfigError as err:
        print_error(str(err), hint)
        return 2
    if _card_or_accumulation_refused(own, rest, hint):
        return 2
    if own.budget is not None:
        from lightning_lowmem.memory.units import describe_bytes

        try:  # before the model loads: a bad size fails at once, a good one says what it was read as
            understood = describe_bytes(own.budget, name="--budget")
        except (ValueError, TypeError) as err:
            print_error(str(err).replace("`--budget`", "--budget"), hint)
            return 2
        print(f"--budget {understood}", file=sys.stderr)
    if own.hf_config is not None:
        return _estimate_hf_config(own, rest, flags, hint)
    if not any(a.startswith(("--config", "--model", "-c")) for a in rest):
        print_error(
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
            from lightning_lowmem.cli.lowmem_cli import lightning_cli  # imports Lightning

            cli = lightning_cli(rest, run=False, estimate_only=True, meta_model=not own.real_weights)
        if batch is None and cli.datamodule is None:
            raise ConfigError(
                "lowmem estimate needs a batch: add --data CLASS_PATH (or a `data:` section) to take one from, or "
                "--batch-shape, e.g. 32x64,32x64 or input_ids=4x128,attention_mask=4x128,labels=4x128"
            )
        techniques = {**configured_techniques(cli), **flags}
        own.accumulate_grad_batches = _accumulation(cli)
        if own.precision is not None:
            techniques["precision"] = own.precision
    except ConfigError as err:
        print_error(str(err), hint)
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
            print_error(str(err).replace("`world_size`", "--devices").replace("`sharding`", "--strategy"), hint)
            return 2
        if own.budget is None and techniques.get("memory_budget") is None:
            techniques = {**techniques, "world_size": devices, "sharding": strategy}
        else:  # plan per GPU: the sharding is a search axis unless --strategy names one
            own.sharding_axis = (devices, [strategy] if own.strategy is not None else None)
    if batch is None:
        batch = _first_batch(cli.datamodule)
    device = own.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return _report(cli.model, batch, techniques, device, own)
    except Exception as err:  # the user's step on this batch: one line, not a traceback (LOWMEM_DEBUG=1: both)
        if os.environ.get("LOWMEM_DEBUG"):
            raise
        print_error(_step_failed(cli.model, batch, err, from_shape=own.batch_shape is not None), hint)
        return 2


def _estimate_hf_config(own: argparse.Namespace, rest: list[str], flags: dict[str, Any], hint: str) -> int:
    """``--hf-config``: the model of a Hugging Face config.json on meta, a dict batch of meta tensors; the
    ``--trainer.*`` options (precision, callbacks, strategy) read as ``lowmem fit`` reads them."""
    from lightning_lowmem.cli.hf_config import hf_config_batch, hf_config_model
    from lightning_lowmem.functional.config import PrecisionConfig

    techniques: dict[str, Any] = {"precision": "32-true"}
    try:
        if any(not arg.startswith("--trainer.") and not arg.startswith("--seed_everything") for arg in rest[:1]):
            raise ConfigError(
                f"--hf-config takes no other model / data options, got {' '.join(rest)}; the --trainer.* options "
                "(precision, callbacks, strategy) are read"
            )
        if rest:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from lightning_lowmem.cli.lowmem_cli import lightning_cli  # imports Lightning

                cli = lightning_cli(
                    ["--model", "lightning_lowmem.cli.lowmem_cli.HFConfigModel", *rest],
                    run=False,
                    estimate_only=True,
                    meta_model=True,
                )
            techniques = configured_techniques(cli)
            own.accumulate_grad_batches = _accumulation(cli)
        techniques.update(flags)
        if own.precision is not None:
            techniques["precision"] = own.precision
        PrecisionConfig(techniques["precision"])
        batch = hf_config_batch(parse_length(own.batch_size, "--batch-size"), parse_length(own.seq_len, "--seq-len"))
        model = hf_config_model(own.hf_config)
    except (ConfigError, ValueError) as err:
        print_error(str(err).replace("`precision`", "--precision"), hint)
        return 2
    if own.devices is not None or own.strategy is not None:
        try:
            devices = int(own.devices) if own.devices is not None else 1
        except ValueError:
            print_error(f"--devices {own.devices!r} must be a number of processes (GPUs)", hint)
            return 2
        strategy = (own.strategy or "ddp").removeprefix("lowmem_")
        if own.budget is None and techniques.get("memory_budget") is None:
            techniques.update(world_size=devices, sharding=strategy)
        else:
            own.sharding_axis = (devices, [strategy] if own.strategy is not None else None)
    if own.device is None and not own.json:  # the question is about a GPU, asked from wherever
        print("--device cuda (the default with --hf-config; --device cpu estimates a CPU step)", file=sys.stderr)
    return _report(model, batch, techniques, own.device or "cuda", own)


def _step_failed(model: Any, batch: Any, err: BaseException, from_shape: bool) -> str:
    """One line for an estimate whose training step failed on ``batch``: what, where, and the likely fix."""
    import traceback

    from lightning_lowmem.cli.errors import one_line
    from lightning_lowmem.model_io import describe_batch

    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    fix = (
        "--batch-shape must give what training_step takes, e.g. 32x64,32x64 for an (inputs, targets) tuple of "
        "int64 token ids (add :float32 only for float inputs), or input_ids=4x128,labels=4x128 for a dict"
        if from_shape
        else "check that the datamodule's batches are what training_step takes"
    )
    return one_line(
        f"the training step of {type(model).__name__} failed on the batch {describe_batch(batch)}: "
        f"{type(err).__name__}: {err}{where}. {fix}; LOWMEM_DEBUG=1 shows the traceback."
    )


def _report(model: Any, batch: Any, techniques: dict[str, Any], device: str, own: argparse.Namespace) -> int:
    """Estimate (or, with ``--budget``, plan) and print; the objects alive before (the imported libraries, the
    model) are out of the garbage collector's sight meanwhile: its full collections during the plan then scan only
    what the plan makes (half a second of the 8B question; no figure depends on when garbage is collected)."""
    gc.freeze()
    try:
        return _estimate_or_plan(model, batch, techniques, device, own)
    finally:
        gc.unfreeze()


def _estimate_or_plan(model: Any, batch: Any, techniques: dict[str, Any], device: str, own: argparse.Namespace) -> int:
    from rich.console import Console

    from lightning_lowmem.cli.estimate_answer import print_answer
    from lightning_lowmem.model_io import describe_batch
    from lightning_lowmem.planning.estimate import EstimationError, TrainingConfig, estimate_memory
    from lightning_lowmem.planning.plan import plan_memory
    from lightning_lowmem.planning.plan_report import rich_progress

    console = Console()
    if not console.is_terminal:  # a pipe or a CI log: wide enough for a column per phase, never wrapped
        console = Console(width=120)
    where = (
        device
        if device == "cuda" or torch.cuda.is_available()
        else "cpu (no CUDA device here; --device cuda plans for a GPU)"
    )
    budget = techniques.pop("memory_budget", None)
    own.budget = own.budget if own.budget is not None else budget
    config = TrainingConfig(**{"optimizer": None, **techniques})  # no optimizer set: configure_optimizers'
    if own.budget is None:
        try:
            report = estimate_memory(
                model, batch, device=device, config=config, attention_kernel=own.attention_kernel, **_step_options(own)
            )
        except EstimationError as err:  # the step cannot run on fake tensors: one line, no traceback
            return _estimation_failed(err, own)
        if own.json:
            print(json.dumps(report.to_dict(), indent=2, default=str))
            return 0
        label = report.meta["label"]
        if "per_rank" in report.meta:
            console.print(_per_rank_table(report, f"Estimated per-rank training step on {where}: {label}"))
        else:
            console.print(report.to_table(title=f"Estimated training step on {where}: {label}"))
        console.print(f"batch: {describe_batch(batch)}", markup=False)
        if "gpu" in report.meta:
            console.print(_card_line(report.meta["gpu"]), markup=False)
        return 0
    loras = [None, {"r": 8}, {"r": 8, "quantize_base": "int8"}] if own.fine_tune else None
    # techniques the config switches on stay on, as LowMemoryStrategy keeps the options it was given;
    # precision and optimizer are the baseline the search starts from
    fixed = config.replace(precision=None, optimizer=None)
    wanted: dict[str, Any] = {"precision": config.precision_preset, "optimizer": config.optimizer}
    # a candidate that cannot run on fake tensors is listed with its error in the plan table; torch
    # also logs the failing op's traceback, which the table already summarises
    fake_logger = logging.getLogger("torch._subclasses.fake_tensor")
    fake_filter = DropMessages(r"^failed while attempting to run meta for ")
    fake_logger.addFilter(fake_filter)
    errors = Console(stderr=True)
    # progress: a transient bar on a terminal (it leaves no line); in a pipe or a log, one line per candidate only
    # with --verbose
    shown = contextlib.nullcontext(None) if not (own.verbose or errors.is_terminal) else rich_progress(errors)
    try:
        with shown as progress:
            world_size, shardings = getattr(own, "sharding_axis", (1, None))
            plan = plan_memory(
                model,
                batch,
                own.budget,
                device=device,
                loras=loras,
                progress=progress,
                config=fixed,
                world_size=world_size,
                shardings=shardings,
                attention_kernel=own.attention_kernel,
                full_check="near-budget",
                **_step_options(own),
                **wanted,
            )
    except ValueError as err:
        if own.json:
            print(json.dumps({"error": str(err)}))
        else:
            console.print(str(err), style="bold red", markup=False)
        return 1
    except EstimationError as err:  # the baseline itself cannot run on fake tensors: one line, no traceback
        return _estimation_failed(err, own)
    finally:
        fake_logger.removeFilter(fake_filter)
    if own.json:
        print(json.dumps(plan.to_dict(), indent=2, default=str))
        return 0
    print_answer(console, plan, where, own.verbose)
    if plan.chosen is not None and "gpu" in plan.chosen.report.meta:
        console.print(_card_line(plan.chosen.report.meta["gpu"]), markup=False)
    return 0


def _card_or_accumulation_refused(own: argparse.Namespace, rest: list[str], hint: str) -> bool:
    """Check ``--gpu`` (it implies ``--device cuda``) and ``--trainer.accumulate_grad_batches`` before any model
    loads; print one error line."""
    from lightning_lowmem.planning.gpus import resolve_card

    flag = "--trainer.accumulate_grad_batches"
    try:
        if own.gpu is not None:
            resolve_card(own.gpu, own.device or "cuda")
            own.device = "cuda"
        for i, arg in enumerate(rest):
            if arg == flag or arg.startswith(flag + "="):
                value = arg.partition("=")[2] if "=" in arg else (rest[i + 1] if i + 1 < len(rest) else "")
                if not value.strip().isdigit() or int(value) < 1:
                    raise ValueError(f"{flag} {value!r} must be a whole number >= 1, e.g. 8")
    except ValueError as err:
        message = str(err).replace("`gpu`=", "--gpu ").replace("`device`=", "--device ").replace("`device`", "--device")
        print_error(message, hint)
        return True
    return False


def _accumulation(cli: Any) -> int:
    """The Trainer's ``accumulate_grad_batches`` as the config (or ``--trainer.accumulate_grad_batches``) sets it."""
    return int((cli.config.get("trainer") or {}).get("accumulate_grad_batches") or 1)


def _step_options(own: argparse.Namespace) -> dict[str, Any]:
    """``--gpu`` and ``--trainer.accumulate_grad_batches`` as ``estimate_memory`` / ``plan_memory`` take them."""
    return {"gpu": own.gpu, "accumulate_grad_batches": getattr(own, "accumulate_grad_batches", 1)}


def _card_line(gpu: dict[str, Any]) -> str:
    """The estimate on the card: allocated, reserved, what nvidia-smi would show, and whether it fits."""
    from lightning_lowmem.memory import format_bytes

    verdict = "fits" if gpu["fits"] else "does NOT fit"
    return (
        f"on {gpu['name']} ({format_bytes(gpu['capacity_bytes'])}): allocated {format_bytes(gpu['allocated_bytes'])}, "
        f"reserved {format_bytes(gpu['reserved_bytes'])}, nvidia-smi ~{format_bytes(gpu['nvidia_smi_bytes'])} "
        f"(reserved + CUDA context + cuBLAS workspace): {verdict}"
    )


def _estimation_failed(err: Exception, own: argparse.Namespace) -> int:
    """Print an :class:`~lightning_lowmem.planning.estimate.EstimationError` as one ``error:`` line (or JSON);
    ``LOWMEM_DEBUG=1`` raises it instead."""
    if debug_enabled():
        raise err
    if own.json:
        print(json.dumps({"error": one_line(err)}))
    else:
        print_error(one_line(err), "LOWMEM_DEBUG=1 shows the full error")
    return 1


def _per_rank_table(report: Any, title: str) -> Any:
    """One row per distinct rank figure (``ranks 0-7`` when all agree): peak and breakdown
    (``estimate_memory(..., world_size=N, sharding=...)``)."""
    from rich.table import Table

    from lightning_lowmem.memory import format_bytes
    from lightning_lowmem.memory.report import CATEGORIES
    from lightning_lowmem.planning.sharding import group_ranks

    table = Table(title=title)  # the label names the sharding and the number of processes: "... + fsdp x8"
    table.add_column("ranks", justify="right")
    for category in CATEGORIES:
        table.add_column(category, justify="right")
    table.add_column("peak", justify="right", style="bold")
    for ranks, figures in group_ranks(report.meta["per_rank"]):
        table.add_row(
            ranks,
            *(format_bytes(figures["breakdown"][c]) for c in CATEGORIES),
            format_bytes(figures["peak_bytes"]),
        )
    for name, value in report.overheads.items():
        table.add_row(f"+ {name}", *[""] * len(CATEGORIES), format_bytes(value))
    return table
