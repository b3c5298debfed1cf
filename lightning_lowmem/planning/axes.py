"""The planner's search axes, in one table (:data:`AXES`): for each axis, the ``plan_memory`` argument that lists
its values, the :class:`TrainingConfig` field it sets, its default values, which side of a step it changes, how
lean each value is, and whether a value never adds memory. The search space, the per-axis measurements' cache
keys, ``plan_memory(config=...)``'s fixed techniques and the order of the leanest checks all read this table:
a new technique is planned by adding its row (and its prior in :data:`~lightning_lowmem.planning.priors.SLOWDOWN`).

Sides: ``"model"`` axes change what forward and backward allocate (the planner runs the model side once per
setting); ``"optimizer"`` axes change the optimizer state and step (profiled once per trainable-parameter set);
``"sharding"`` axes split a step over processes (estimated per rank, in full).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from torch import nn

from lightning_lowmem.functional.config import TrainingConfig
from lightning_lowmem.functional.config.techniques import SHARDINGS, ShardingConfig
from lightning_lowmem.planning.priors import PRECISION_RANK

__all__ = ["AXES", "Axis", "AxisContext", "axis", "carried", "check_estimable", "leanness", "model_side_key"]


@dataclass(frozen=True)
class AxisContext:
    """What an axis's default values depend on: the configuration asked for, the model and its batch."""

    precision: str
    optimizer: str
    batch_size: int | None
    module: nn.Module
    world_size: int = 1


@dataclass(frozen=True)
class Axis:
    """One search axis of :func:`~lightning_lowmem.planning.plan.plan_memory`.

    Attributes:
        argument: the ``plan_memory`` argument listing its values (``"precisions"``).
        field: the :class:`TrainingConfig` field a value sets (``"precision"``).
        side: ``"model"``, ``"optimizer"`` or ``"sharding"`` (module docstring).
        defaults: the default values in words (for docs and ``--help``).
        default_values: ``default_values(context)``: the values searched when the argument is ``None``.
        leanness: ``leanness(config)``: a tuple, larger = this axis's setting is expected to use less memory.
        lean_rank: the axis's place in the leanness key (lower = compared first; see :func:`leanness`).
        fallback_values: ``fallback_values(context)``: values searched in a last stage, only when no candidate
            of the first stage fits (micro-batches); ``None``: none.
        never_adds_memory: a value whose candidate never needs more memory than the same candidate with the axis
            off (``None``): the planner predicts the candidate with it first, and a candidate without it only if
            that one fits (a dominance shortcut). ``None``: no such value.
    """

    argument: str
    field: str
    side: str
    defaults: str
    default_values: Callable[[AxisContext], list[Any]]
    leanness: Callable[[TrainingConfig], tuple[int, ...]]
    lean_rank: int
    fallback_values: Callable[[AxisContext], list[Any]] | None = None
    never_adds_memory: Any = None


def _default_optimizers(context: AxisContext) -> list[str]:
    """The configured optimizer and, for the Adam family, 8-bit AdamW (same hyperparameters and lr)."""
    from lightning_lowmem.functional.optimizers.catalog import available_optimizers

    names = [context.optimizer]
    if context.optimizer in ("adamw", "adam") and "adamw8bit" in available_optimizers():
        names.append("adamw8bit")
    return names


def _halves(context: AxisContext) -> list[int]:
    """B/2, B/4, ..., 1 for a batch of B samples (none when the batch size is unknown)."""
    halves, size = [], context.batch_size // 2 if context.batch_size else 0
    while size >= 1:
        halves.append(size)
        size //= 2
    return halves


def _default_cross_entropies(context: AxisContext) -> list[Any]:
    """The chunked loss where it needs no change to the training step (a Hugging Face causal LM)."""
    from lightning_lowmem.functional.cross_entropy.models import routes_loss

    return [None, "chunked"] if routes_loss(context.module) else [None]


def _default_shardings(context: AxisContext) -> list[Any]:
    if context.world_size == 1:
        return [None]
    return [ShardingConfig(kind, context.world_size) for kind in SHARDINGS]


_COMPRESSION_RANK = {"int8": 3, "cpu": 2, "bf16": 1}
_OPTIMIZER_RANK = {"adamw4bit": 4, "adamw8bit": 3, "adafactor": 2, "sgd": 1}

AXES: tuple[Axis, ...] = (
    Axis(
        "precisions",
        "precision",
        "model",
        "{precision, bf16-mixed, bf16-true}",
        lambda c: list(dict.fromkeys([c.precision, "bf16-mixed", "bf16-true"])),
        lambda t: (PRECISION_RANK.get(t.precision_preset or "32-true", 0),),
        lean_rank=1,
    ),
    Axis(
        "checkpointing",
        "checkpointing",
        "model",
        "{None, 'auto'}",
        lambda c: [None, "auto"],
        lambda t: (t.checkpointing is not None,),
        lean_rank=2,
    ),
    Axis(
        "compressions",
        "compression",
        "model",
        "{None, 'bf16', 'int8'}",
        lambda c: [None, "bf16", "int8"],
        lambda t: (_COMPRESSION_RANK.get(t.activation_compression or "", 0),),
        lean_rank=4,
    ),
    Axis(
        "optimizers",
        "optimizer",
        "optimizer",
        "{optimizer, 'adamw8bit' for adamw / adam}",
        _default_optimizers,
        lambda t: (_OPTIMIZER_RANK.get((t.optimizer_name or "").removesuffix("_in_backward"), 0),),
        lean_rank=5,
    ),
    Axis(
        "micro_batch_sizes",
        "microbatch",
        "model",
        "whole batches, then {B/2, B/4, ..., 1}",
        lambda c: [None],
        lambda t: (-(t.micro_batch_size or 10**9),),
        lean_rank=6,
        fallback_values=_halves,
    ),
    Axis(
        "loras",
        "lora",
        "model",
        "{None}",
        lambda c: [None],
        lambda t: (t.lora is not None and bool(t.lora.quantize_base), t.lora is not None),
        lean_rank=0,
    ),
    Axis(
        "cross_entropies",
        "cross_entropy",
        "model",
        "{None, 'chunked'} for a Hugging Face causal LM, else {None}",
        _default_cross_entropies,
        lambda t: (t.cross_entropy is not None,),
        lean_rank=3,
        never_adds_memory="chunked",
    ),
    Axis(
        "shardings",
        "sharding",
        "sharding",
        "{'ddp', 'zero1', 'fsdp'} when world_size > 1",
        _default_shardings,
        lambda t: (),
        lean_rank=7,
    ),
)
"""Every search axis, in the order the search space is built (``itertools.product`` over the rows: ties in the
prior slowdown keep this order)."""


def axis(argument: str) -> Axis:
    """The row of :data:`AXES` for a ``plan_memory`` argument (``"precisions"``) or a config field (``"precision"``).

    Example::

        >>> axis("cross_entropies").field, axis("lora").side
        ('cross_entropy', 'model')
    """
    for row in AXES:
        if argument in (row.argument, row.field):
            return row
    raise KeyError(f"no search axis {argument!r}; axes: {', '.join(row.argument for row in AXES)}")


def carried(config: TrainingConfig) -> dict[str, Any]:
    """The techniques ``config`` sets that no axis searches (pruning, QAT, one registered later): ``plan_memory``
    keeps each in every candidate, by field. Quantization and sharding have their own rules (:mod:`.search`)."""
    searched = {row.field for row in AXES} | {"quantization", "sharding"}
    return {field: value for field, value in config.configs().items() if field not in searched and value is not None}


def check_estimable(config: TrainingConfig, who: str) -> None:
    """Refuse (``ValueError``, one line) a config with a technique the estimator cannot run on fake tensors (its
    registered ``not_estimated`` reason); ``who`` names the caller (``"estimate_memory"``)."""
    from lightning_lowmem.functional.registry import technique

    for field, value in config.configs().items():
        reason = technique(field).not_estimated if value is not None else None
        if reason is not None:
            raise ValueError(
                f"{who} cannot estimate `{field}` ({technique(field).label(value) or field}): {reason}. Give the mix "
                f"without it (config.replace({field}=None))"
            )


def model_side_key(config: TrainingConfig) -> tuple[Any, ...]:
    """``config``'s settings of the model-side axes: candidates with the same key share one model-side run."""
    return tuple(getattr(config, row.field) for row in AXES if row.side == "model")


def leanness(config: TrainingConfig) -> tuple[int, ...]:
    """Sort key: larger = expected to use less memory (every technique at its strongest), the axes compared in
    ``lean_rank`` order (LoRA, precision, checkpointing, chunked loss, compression, optimizer, micro-batch)."""
    return sum((row.leanness(config) for row in sorted(AXES, key=lambda row: row.lean_rank)), ())


def fixed_axes(config: TrainingConfig, precision: str) -> tuple[str, dict[str, list[Any]]]:
    """What ``plan_memory(config=...)`` keeps fixed: each technique ``config`` sets, as a one-value axis (by
    ``plan_memory`` argument; the optimizer by name); its precision becomes the baseline (and its optimizer, see
    :class:`PlanSearch`)."""
    if not isinstance(config, TrainingConfig):
        raise TypeError(f"`config` must be a TrainingConfig, got {type(config).__name__}: {config!r}")
    if config.quantization is not None:
        raise ValueError(
            f"plan_memory plans a training mix; `config` sets quantization ({config.describe()!r}). Estimate a "
            "quantized mix with estimate_memory(config=...)."
        )
    check_estimable(config, "plan_memory")  # pruning: refused in one line (a technique no axis searches is carried)
    fixed: dict[str, list[Any]] = {}
    if config.precision is not None:
        precision = config.precision.preset
    optimizer = config.optimizer_name
    for row in AXES:
        value = getattr(config, row.field)
        if row.side == "sharding" or value is None:
            continue  # the sharding: its kind and world size, see sharding_axis
        fixed[row.argument] = [{"precision": precision, "optimizer": optimizer}.get(row.field, value)]
    if config.sharding is not None:
        fixed["shardings"] = [config.sharding.kind]
    return precision, fixed


def sharding_axis(world_size: int, shardings: Iterable[str] | None) -> list[ShardingConfig]:
    """The sharding axis: empty for one process, else each kind at ``world_size`` (validated)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size`={world_size!r} must be an int >= 1: the number of processes (GPUs)")
    if world_size == 1:
        if shardings is not None and list(shardings) not in ([], ["ddp"]):
            raise ValueError(
                f"`shardings`={list(shardings)!r} needs `world_size` > 1: one process has nothing to shard"
            )
        return []
    kinds = list(dict.fromkeys(shardings if shardings is not None else SHARDINGS))
    if not kinds:
        raise ValueError("`shardings` is empty; give at least one of 'ddp', 'zero1', 'fsdp'")
    return [ShardingConfig(kind, world_size) for kind in kinds]
