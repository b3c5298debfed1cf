"""`LowMemoryStrategy` / `LowMemoryDDPStrategy`: a run's memory settings in one Lightning strategy.

Registered in Lightning's ``StrategyRegistry`` as ``"lowmem"``, ``"lowmem_ddp"`` and
``"lowmem_ddp_spawn"`` (``import lightning_lowmem`` is enough). The options are sugar for one
:class:`~lightning_lowmem.functional.config.TrainingConfig` (``strategy.config``), applied with
:func:`lightning_lowmem.functional.apply` and the strategy's own hooks; no callback is added to the
Trainer. What each option does:

* ``precision``: a Lightning preset applied as Lightning's own precision plugin; ``"bf16-true"``
  pairs with ``optimizer="adamw_bf16_sr"`` (stochastic rounding of the update).
* ``optimizer``: replace the optimizer ``configure_optimizers`` returns by a name from
  ``functional.optimizers`` (e.g. ``"adamw8bit"``), same param groups / ``lr`` / ``weight_decay``,
  in ``setup_optimizers`` (``functional.optimizers.convert``, as ``MemoryEfficientOptimizer`` does).
* ``activation_checkpointing`` / ``activation_compression``: ``functional.checkpointing.checkpoint_``
  on the model, ``functional.compression.compress_activations`` around every training step.
* ``memory_budget``: before training, one batch is taken from the train dataloader and
  ``planning.plan.plan_memory`` picks the cheapest mix of the options above whose estimated peak fits;
  options set explicitly stay fixed. An impossible budget fails before the first step.
* ``expandable_segments``: the CUDA caching allocator setting, written before CUDA initialises.
* ``prefetch``: on CUDA, the next batch is copied from pinned memory on a side stream while this one
  trains (a no-op on CPU). Either way the first batch is checked against the DataLoader's queue size.
* DDP only: gradients live inside DDP's buckets (``gradient_as_bucket_view=True``), ``bucket_cap_mb``,
  and ``zero_optimizer=True`` shards optimizer state with ``ZeroRedundancyOptimizer`` (ZeRO-1);
  checkpoints hold the full state, so a run resumes on any number of processes.

When no mix fits whole batches, ``memory_budget`` also plans micro-batches (B/2, B/4, ..., 1) and runs
them with ``AutoMicrobatch``'s loop (``functional.microbatch.MicrobatchLoop``: same effective batch and
optimizer steps); not with optimizer-in-backward.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry
from typing_extensions import override

from lightning_lowmem.functional.config import OptimizerConfig
from lightning_lowmem.functional.config.constants import COMPRESSION_MIN_BYTES
from lightning_lowmem.strategies._options import (
    PRECISION_PRESETS,
    LowMemoryOptions,
    precision_plugin,
    validate_precision,
)
from lightning_lowmem.warnings import LowMemWarning

__all__ = ["PRECISION_PRESETS", "LowMemoryDDPStrategy", "LowMemoryStrategy", "register_lowmem_strategies"]

_ZERO_FALLBACK = (
    "zero_optimizer=True needs a distributed run (ZeRO-1 shards optimizer state across processes); falling back "
    "to the unsharded optimizer. Use strategy='lowmem_ddp' with devices>1 (or several nodes)."
)


class LowMemoryStrategy(LowMemoryOptions, SingleDeviceStrategy):
    """Single-device strategy with memory settings; registered as ``"lowmem"``.

    Args:
        device: the device, or ``None``: the Trainer accelerator's first device (``cuda:0`` with
            ``accelerator="gpu"``, else the CPU). Default: ``None``.
        precision: a preset from :data:`PRECISION_PRESETS` or ``None`` (use the Trainer's). Default: ``None``.
        activation_checkpointing: a ``checkpoint_`` policy (``"auto"``, a class name, a pattern, every-k
            int, or a list of names / patterns) or ``None``. Default: ``None``.
        nested_checkpointing: also checkpoint matching modules inside checkpointed ones (e.g.
            ``["Block", "*.attn"]``), as ``ActivationCheckpointing(nested=True)``. Default: ``False``.
        activation_compression: ``"bf16"``, ``"int8"``, ``"cpu"`` or ``None``. Default: ``None``.
        memory_budget: bytes or a string like ``"12GiB"``: plan and apply a technique mix that fits (see
            the module docstring). Default: ``None``.
        zero_optimizer: shard optimizer state (DDP only; warns and falls back here). Default: ``False``.
        optimizer: an :class:`~lightning_lowmem.functional.config.OptimizerConfig` (a name and its
            hyperparameters; YAML: ``{name: adamw8bit, hyperparameters: {lr: 0.001}}``) or a
            :func:`~lightning_lowmem.functional.optimizers.available_optimizers` name, that replaces the
            configured optimizer (``lr`` / ``weight_decay`` kept unless given). Default: ``None`` (keep).
        optimizer_kwargs: with ``optimizer=None``, the configured optimizer's arguments for the
            ``memory_budget`` planner. Deprecated with a named ``optimizer`` (a ``DeprecationWarning``): give
            ``OptimizerConfig(name, **hyperparameters)`` instead. Default: ``None``.
        compression_min_bytes: saved tensors smaller than this are not compressed. Default: ``COMPRESSION_MIN_BYTES`` (64 KiB).
        expandable_segments: set the CUDA allocator's ``expandable_segments`` before CUDA initialises
            (``None``: leave it). Default: ``None``.
        prefetch: copy the next batch to the GPU on a side stream while this one trains (CUDA only).
            Default: ``False``.
        **kwargs: passed to Lightning's ``SingleDeviceStrategy``.

    Raises:
        ValueError: unknown preset / compression mode / optimizer, a budget that does not parse; at
            ``fit``: no technique mix fits ``memory_budget``.

    Example::

        >>> strategy = LowMemoryStrategy(precision="bf16-true", optimizer="adamw_bf16_sr")
        >>> strategy.precision_plugin.precision
        'bf16-true'
    """

    strategy_name = "lowmem"

    def __init__(
        self,
        device: Any = None,
        precision: str | None = None,
        activation_checkpointing: str | int | list[str] | None = None,
        nested_checkpointing: bool = False,
        activation_compression: str | None = None,
        memory_budget: int | str | None = None,
        zero_optimizer: bool = False,
        optimizer: str | OptimizerConfig | None = None,
        optimizer_kwargs: dict[str, Any] | None = None,
        compression_min_bytes: int = COMPRESSION_MIN_BYTES,
        expandable_segments: bool | None = None,
        prefetch: bool = False,
        **kwargs: Any,
    ) -> None:
        validate_precision(precision)
        kwargs.setdefault("precision_plugin", precision_plugin(precision))
        super().__init__(device="cpu" if device is None else device, **kwargs)
        self._device_from_accelerator = device is None
        self._accelerator_device: torch.device | None = None
        self._init_options(
            precision=precision,
            optimizer=optimizer,
            optimizer_kwargs=optimizer_kwargs,
            activation_checkpointing=activation_checkpointing,
            nested_checkpointing=nested_checkpointing,
            activation_compression=activation_compression,
            compression_min_bytes=compression_min_bytes,
            memory_budget=memory_budget,
            zero_optimizer=zero_optimizer,
            expandable_segments=expandable_segments,
            prefetch=prefetch,
        )
        if zero_optimizer:
            warnings.warn(f"LowMemoryStrategy(zero_optimizer=True): {_ZERO_FALLBACK}", LowMemWarning, stacklevel=2)
            self.zero_optimizer = False

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._device_from_accelerator or self.accelerator is None:
            return super().root_device
        if self._accelerator_device is None:  # Lightning gives a single-device strategy no device: ask the accelerator
            accelerator = type(self.accelerator)
            self._accelerator_device = accelerator.get_parallel_devices(accelerator.parse_devices(1))[0]
        return self._accelerator_device

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        from lightning_lowmem.checkpoints.sharded import reject_sharded_checkpoint

        reject_sharded_checkpoint(checkpoint_path, f"strategy={self.strategy_name!r}")
        return super().load_checkpoint(checkpoint_path, weights_only)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("lowmem", cls, description="LowMemoryStrategy (single device)", override=True)


class LowMemoryDDPStrategy(LowMemoryOptions, DDPStrategy):
    """DDP with memory settings; registered as ``"lowmem_ddp"`` (and ``"lowmem_ddp_spawn"``).

    Gradients are views into DDP's communication buckets (``gradient_as_bucket_view=True``), so they
    are not held twice. Arguments as :class:`LowMemoryStrategy` (without ``device``), plus:

    Args:
        zero_optimizer: ZeRO-1: wrap each configured optimizer (its class, param groups and
            hyperparameters; or the ``optimizer=`` name) in ``ZeroRedundancyOptimizer``, so each
            process keeps about ``1 / world_size`` of the optimizer state. Checkpoints hold the full,
            consolidated state (gathered to rank 0 on save) and load on any world size. With one
            process it warns and keeps the plain optimizer. Default: ``False``.
        bucket_cap_mb: DDP gradient bucket size in MiB. Default: 25.
        **kwargs: passed to Lightning's ``DDPStrategy`` (e.g. ``start_method``, ``ddp_comm_hook``,
            ``gradient_as_bucket_view=False`` to opt out).

    Raises:
        ValueError: as :class:`LowMemoryStrategy`; a non-positive ``bucket_cap_mb``; ``zero_optimizer``
            with an ``*_in_backward`` optimizer.
    """

    strategy_name = "lowmem_ddp"

    def __init__(
        self,
        precision: str | None = None,
        activation_checkpointing: str | int | list[str] | None = None,
        nested_checkpointing: bool = False,
        activation_compression: str | None = None,
        memory_budget: int | str | None = None,
        zero_optimizer: bool = False,
        bucket_cap_mb: float = 25,
        optimizer: str | OptimizerConfig | None = None,
        optimizer_kwargs: dict[str, Any] | None = None,
        compression_min_bytes: int = COMPRESSION_MIN_BYTES,
        expandable_segments: bool | None = None,
        prefetch: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"`bucket_cap_mb` must be a positive number, got {bucket_cap_mb!r}")
        validate_precision(precision)
        kwargs.setdefault("gradient_as_bucket_view", True)
        kwargs.setdefault("precision_plugin", precision_plugin(precision))
        super().__init__(bucket_cap_mb=bucket_cap_mb, **kwargs)
        self._init_options(
            precision=precision,
            optimizer=optimizer,
            optimizer_kwargs=optimizer_kwargs,
            activation_checkpointing=activation_checkpointing,
            nested_checkpointing=nested_checkpointing,
            activation_compression=activation_compression,
            compression_min_bytes=compression_min_bytes,
            memory_budget=memory_budget,
            zero_optimizer=zero_optimizer,
            expandable_segments=expandable_segments,
            prefetch=prefetch,
        )

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if not self.zero_optimizer:
            return
        if self.world_size < 2:
            warnings.warn(
                f"LowMemoryDDPStrategy with world_size={self.world_size}: {_ZERO_FALLBACK}", LowMemWarning, stacklevel=2
            )
            return
        from lightning_lowmem.strategies.zero import shard_optimizer

        sharded = {id(opt): shard_optimizer(opt, self.optimizer_name) for opt in self.optimizers}
        self.optimizers = [sharded[id(opt)] for opt in self.optimizers]
        for config in self.lr_scheduler_configs:  # schedulers now drive the wrapper's param groups
            scheduler = config.scheduler
            if id(getattr(scheduler, "optimizer", None)) in sharded:
                scheduler.optimizer = sharded[id(scheduler.optimizer)]  # type: ignore[union-attr]

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        from lightning_lowmem.checkpoints.sharded import reject_sharded_checkpoint

        reject_sharded_checkpoint(checkpoint_path, f"strategy={self.strategy_name!r}")
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)  # a ZeRO wrapper keeps its own shard of the full state
        from lightning_lowmem.strategies.zero import drop_duplicate_state, reload_local_state

        for optimizer in self.optimizers:
            drop_duplicate_state(optimizer)
            reload_local_state(optimizer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("lowmem_ddp", cls, description="LowMemoryDDPStrategy", override=True)
        strategy_registry.register(
            "lowmem_ddp_spawn", cls, description="LowMemoryDDPStrategy (spawn)", start_method="spawn", override=True
        )


def register_lowmem_strategies() -> None:
    """Add ``"lowmem"``, ``"lowmem_ddp"`` and ``"lowmem_ddp_spawn"`` to Lightning's ``StrategyRegistry`` (idempotent)."""
    LowMemoryStrategy.register_strategies(StrategyRegistry)
    LowMemoryDDPStrategy.register_strategies(StrategyRegistry)


register_lowmem_strategies()
