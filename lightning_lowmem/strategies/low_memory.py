"""`LowMemoryStrategy` / `LowMemoryDDPStrategy`: memory settings in one Lightning strategy.

Partial implementation: precision presets (applied as Lightning precision plugins), DDP ``gradient_as_bucket_view``
and bucket size, activation checkpointing / compression through the functional transforms, argument
validation. ZeRO-1, prefetch, ``memory_budget`` planning and stochastic rounding are not wired yet.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry
from typing_extensions import override

from lightning_lowmem.memory.units import parse_bytes
from lightning_lowmem.warnings import LowMemWarning

__all__ = ["PRECISION_PRESETS", "LowMemoryDDPStrategy", "LowMemoryStrategy", "register_lowmem_strategies"]

PRECISION_PRESETS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def _precision_plugin(preset: str | None) -> Any:
    """Lightning's precision plugin for a preset (``None`` -> let the Trainer's ``precision`` decide)."""
    if preset is None:
        return None
    import torch
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    if preset == "32-true":
        return Precision()
    if preset.endswith("-true"):
        return HalfPrecision(preset)  # type: ignore[arg-type]
    return MixedPrecision(preset, "cuda" if torch.cuda.is_available() else "cpu")  # type: ignore[arg-type]


class _LowMemoryOptions:
    """Validation and application of the options both strategies share."""

    def _init_options(
        self,
        precision: str | None,
        activation_checkpointing: str | int | None,
        activation_compression: str | None,
        memory_budget: int | str | None,
        zero_optimizer: bool,
    ) -> None:
        if precision is not None and precision not in PRECISION_PRESETS:
            raise ValueError(f"`precision`={precision!r} is not a known preset; choose one of {list(PRECISION_PRESETS)}")
        if activation_compression not in (None, "bf16", "int8", "cpu"):
            raise ValueError(
                f"`activation_compression`={activation_compression!r} is unknown; choose None, 'bf16', 'int8' or 'cpu'"
            )
        if activation_checkpointing is not None:
            from lightning_lowmem.functional.checkpointing import _validate_policy

            _validate_policy(activation_checkpointing)
        self.memory_budget_bytes = None if memory_budget is None else parse_bytes(memory_budget, name="memory_budget")
        self.precision_preset = precision
        self.activation_checkpointing = activation_checkpointing
        self.activation_compression = activation_compression
        self.zero_optimizer = zero_optimizer
        self.checkpointed: list[str] = []

    def _apply_model_options(self) -> None:
        module = self.lightning_module  # type: ignore[attr-defined]
        if self.activation_checkpointing is not None and module is not None and not self.checkpointed:
            from lightning_lowmem.functional.checkpointing import checkpoint_

            self.checkpointed = checkpoint_(module, self.activation_checkpointing).wrapped

    def _release_model_options(self) -> None:
        module = self.lightning_module  # type: ignore[attr-defined]
        if self.checkpointed and module is not None:
            from lightning_lowmem.functional.checkpointing import uncheckpoint_

            uncheckpoint_(module, self.checkpointed)
        self.checkpointed = []

    def _compression_context(self) -> Any:
        if self.activation_compression is None:
            return contextlib.nullcontext()
        from lightning_lowmem.functional.compression import compress_activations

        return compress_activations(self.activation_compression)


class LowMemoryStrategy(_LowMemoryOptions, SingleDeviceStrategy):
    """Single-device strategy with memory settings; registered as ``"lowmem"``.

    Args:
        device: the device. Default: ``"cpu"`` (Lightning's accelerator flag decides for ``"lowmem"``).
        precision: a preset from :data:`PRECISION_PRESETS` or ``None`` (use the Trainer's). Default: ``None``.
        activation_checkpointing: a ``checkpoint_`` policy or ``None``. Default: ``None``.
        activation_compression: ``"bf16"``, ``"int8"``, ``"cpu"`` or ``None``. Default: ``None``.
        memory_budget: bytes or a string like ``"12GiB"`` (validated; planning not wired yet). Default: ``None``.
        zero_optimizer: shard optimizer state (DDP only; warns and falls back here). Default: ``False``.

    Raises:
        ValueError: unknown preset / compression mode, or a budget that does not parse.
    """

    strategy_name = "lowmem"

    def __init__(
        self,
        device: Any = "cpu",
        precision: str | None = None,
        activation_checkpointing: str | int | None = None,
        activation_compression: str | None = None,
        memory_budget: int | str | None = None,
        zero_optimizer: bool = False,
        **kwargs: Any,
    ) -> None:
        if precision is not None and precision not in PRECISION_PRESETS:
            raise ValueError(f"`precision`={precision!r} is not a known preset; choose one of {list(PRECISION_PRESETS)}")
        kwargs.setdefault("precision_plugin", _precision_plugin(precision))
        super().__init__(device=device, **kwargs)
        self._init_options(precision, activation_checkpointing, activation_compression, memory_budget, zero_optimizer)
        if zero_optimizer:
            warnings.warn(
                "LowMemoryStrategy(zero_optimizer=True) needs a distributed run (ZeRO-1 shards optimizer state "
                "across processes); falling back to the unsharded optimizer. Use strategy='lowmem_ddp' with devices>1.",
                LowMemWarning,
                stacklevel=2,
            )
            self.zero_optimizer = False

    @override
    def setup(self, trainer: Any) -> None:
        self._apply_model_options()
        super().setup(trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._compression_context():
            return super().training_step(*args, **kwargs)

    @override
    def teardown(self) -> None:
        self._release_model_options()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("lowmem", cls, description="LowMemoryStrategy (single device)", override=True)


class LowMemoryDDPStrategy(_LowMemoryOptions, DDPStrategy):
    """DDP with memory settings: gradients kept inside DDP's buckets (``gradient_as_bucket_view``).

    Registered as ``"lowmem_ddp"``. Arguments as :class:`LowMemoryStrategy`, plus:

    Args:
        bucket_cap_mb: DDP gradient bucket size in MiB. Default: 25.
        **kwargs: passed to Lightning's ``DDPStrategy`` (e.g. ``start_method``).
    """

    strategy_name = "lowmem_ddp"

    def __init__(
        self,
        precision: str | None = None,
        activation_checkpointing: str | int | None = None,
        activation_compression: str | None = None,
        memory_budget: int | str | None = None,
        zero_optimizer: bool = False,
        bucket_cap_mb: float = 25,
        **kwargs: Any,
    ) -> None:
        if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"`bucket_cap_mb` must be a positive number, got {bucket_cap_mb!r}")
        if precision is not None and precision not in PRECISION_PRESETS:
            raise ValueError(f"`precision`={precision!r} is not a known preset; choose one of {list(PRECISION_PRESETS)}")
        kwargs.setdefault("gradient_as_bucket_view", True)
        kwargs.setdefault("precision_plugin", _precision_plugin(precision))
        super().__init__(bucket_cap_mb=bucket_cap_mb, **kwargs)
        self._init_options(precision, activation_checkpointing, activation_compression, memory_budget, zero_optimizer)

    @override
    def setup(self, trainer: Any) -> None:
        self._apply_model_options()
        super().setup(trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._compression_context():
            return super().training_step(*args, **kwargs)

    @override
    def teardown(self) -> None:
        self._release_model_options()
        super().teardown()

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
