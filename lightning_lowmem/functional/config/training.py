"""`TrainingConfig`: the per-technique configs composed into one technique mix, with the flat shorthands."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from lightning_lowmem.functional.compression import DEFAULT_MIN_BYTES
from lightning_lowmem.functional.config.techniques import (
    CheckpointingConfig,
    CompressionConfig,
    CrossEntropyConfig,
    LoRAConfig,
    MicrobatchConfig,
    OptimizerConfig,
    PrecisionConfig,
    QuantizationConfig,
    ShardingConfig,
    _check_bool,
)

__all__ = ["TrainingConfig"]


# ----------------------------------------------------------------------------- the composed mix
def _coerce(field: str, value: Any, kind: type, shorthand: Any) -> Any:
    """``value`` as a ``kind`` config: kept if it is one, built from a mapping, else from ``shorthand(value)``."""
    if value is None or isinstance(value, kind):
        return value
    if isinstance(value, Mapping):
        return kind(**value)
    return shorthand(value)


@contextlib.contextmanager
def _named(**arguments: str) -> Iterator[None]:
    """Errors of a config built from a shorthand name the argument the user wrote (``min_bytes`` ->
    ``compression_min_bytes``)."""
    try:
        yield
    except (ValueError, TypeError) as err:
        message = str(err)
        for field, argument in arguments.items():
            message = message.replace(f"`{field}`", f"`{argument}`")
        if message == str(err):
            raise
        raise type(err)(message) from err


def _lora_shorthand(value: Any) -> LoRAConfig:
    if isinstance(value, tuple) and all(isinstance(item, tuple) and len(item) == 2 for item in value):
        return LoRAConfig(**dict(value))  # the (key, value) pairs earlier versions stored
    if isinstance(value, int) and not isinstance(value, bool):
        return LoRAConfig(r=value)
    raise TypeError(f"`lora`={value!r} must be a LoRAConfig, a mapping of apply_lora_ arguments (e.g. {{'r': 8}}) or None")


def _cross_entropy_shorthand(value: Any) -> CrossEntropyConfig:
    if isinstance(value, str):
        return CrossEntropyConfig(value)
    raise TypeError(
        f"`cross_entropy`={value!r} must be 'chunked', a CrossEntropyConfig, a mapping of its arguments "
        "(e.g. {'chunk_size': 1024}) or None"
    )


@dataclass(frozen=True, init=False)
class TrainingConfig:
    """One technique mix: what a training step is estimated, planned and run with.

    Every field is a per-technique config (``None``: the technique is off). The constructor also takes
    the flat shorthands users write, and turns them into those configs:

    ============================================  ==============================================
    shorthand                                     field
    ============================================  ==============================================
    ``precision="bf16-true"``                     ``precision=PrecisionConfig("bf16-true")``
    ``activation_checkpointing="auto"``,          ``checkpointing=CheckpointingConfig("auto", nested=...)``
    ``nested_checkpointing=True``
    ``activation_compression="int8"``,           ``compression=CompressionConfig("int8", min_bytes=...)``
    ``compression_min_bytes=0``
    ``optimizer="adamw8bit"``,                    ``optimizer=OptimizerConfig("adamw8bit", lr=1e-3)``
    ``optimizer_kwargs={"lr": 1e-3}``
    ``micro_batch_size=4``                        ``microbatch=MicrobatchConfig(4)``
    ``lora={"r": 8}``                             ``lora=LoRAConfig(r=8)``
    ``quantization="int8_weight_only"``           ``quantization=QuantizationConfig("int8_weight_only")``
    ``sharding="fsdp", world_size=8``             ``sharding=ShardingConfig("fsdp", 8)``
    ``cross_entropy="chunked"``                   ``cross_entropy=CrossEntropyConfig("chunked")``
    ============================================  ==============================================

    ``precision=None`` / ``optimizer=None`` mean "as configured elsewhere" (the Trainer's precision,
    ``configure_optimizers``' optimizer): the strategies use them for what the user did not set.

    Raises:
        ValueError / TypeError: from the per-technique configs; a technique given both as a field and
            as its shorthand.

    Example::

        >>> config = TrainingConfig(optimizer="adamw8bit", micro_batch_size=4, lora={"r": 8})
        >>> config.microbatch, config.lora.r
        (MicrobatchConfig(size=4), 8)
        >>> config.describe()
        '32-true + lora(r=8) + adamw8bit + mb 4'
    """

    precision: PrecisionConfig | None
    checkpointing: CheckpointingConfig | None
    compression: CompressionConfig | None
    optimizer: OptimizerConfig | None
    microbatch: MicrobatchConfig | None
    lora: LoRAConfig | None
    quantization: QuantizationConfig | None
    sharding: ShardingConfig | None
    cross_entropy: CrossEntropyConfig | None

    def __init__(
        self,
        precision: PrecisionConfig | str | None = "32-true",
        checkpointing: CheckpointingConfig | Any = None,
        compression: CompressionConfig | str | None = None,
        optimizer: OptimizerConfig | str | None = "adamw",
        microbatch: MicrobatchConfig | int | None = None,
        lora: LoRAConfig | Mapping[str, Any] | None = None,
        quantization: QuantizationConfig | Any = None,
        sharding: ShardingConfig | str | None = None,
        cross_entropy: CrossEntropyConfig | str | Mapping[str, Any] | None = None,
        *,
        activation_checkpointing: Any = None,
        nested_checkpointing: bool | None = None,
        activation_compression: str | None = None,
        compression_min_bytes: int | None = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        micro_batch_size: int | None = None,
        world_size: int | None = None,
    ) -> None:
        for field, short, value, long in (
            ("checkpointing", "activation_checkpointing", activation_checkpointing, checkpointing),
            ("compression", "activation_compression", activation_compression, compression),
            ("microbatch", "micro_batch_size", micro_batch_size, microbatch),
        ):
            if value is not None and long is not None:
                raise ValueError(f"`{short}`={value!r} and `{field}`={long!r} set the same technique; give one")
        checkpointing = checkpointing if checkpointing is not None else activation_checkpointing
        compression = compression if compression is not None else activation_compression
        microbatch = microbatch if microbatch is not None else micro_batch_size
        if nested_checkpointing is not None:
            _check_bool("nested_checkpointing", nested_checkpointing)
            if checkpointing is None and nested_checkpointing:
                raise ValueError("`nested_checkpointing`=True needs `activation_checkpointing` (a policy to nest)")
        if checkpointing is not None and not isinstance(checkpointing, (CheckpointingConfig, Mapping)):
            with _named(policy="activation_checkpointing", nested="nested_checkpointing"):
                checkpointing = CheckpointingConfig(checkpointing, nested=bool(nested_checkpointing))
        if compression is not None and not isinstance(compression, (CompressionConfig, Mapping)):
            min_bytes = DEFAULT_MIN_BYTES if compression_min_bytes is None else compression_min_bytes
            with _named(mode="activation_compression", min_bytes="compression_min_bytes"):
                compression = CompressionConfig(compression, min_bytes=min_bytes)
        if optimizer_kwargs:
            if not isinstance(optimizer, str):
                raise ValueError(
                    f"`optimizer_kwargs`={dict(optimizer_kwargs)!r} needs `optimizer` as a name, got {optimizer!r}; "
                    "give the arguments to OptimizerConfig instead"
                )
            optimizer = OptimizerConfig(optimizer, optimizer_kwargs)
        if isinstance(sharding, str) or (sharding is None and world_size not in (None, 1)):
            sharding = ShardingConfig(sharding or "ddp", world_size if world_size is not None else 1)
        elif world_size is not None and world_size != getattr(sharding, "world_size", 1):
            raise ValueError(f"`world_size`={world_size!r} disagrees with `sharding`={sharding!r}; give it once")
        values = {
            "precision": _coerce("precision", precision, PrecisionConfig, PrecisionConfig),
            "checkpointing": _coerce("checkpointing", checkpointing, CheckpointingConfig, CheckpointingConfig),
            "compression": _coerce("compression", compression, CompressionConfig, CompressionConfig),
            "optimizer": _coerce("optimizer", optimizer, OptimizerConfig, OptimizerConfig),
            "microbatch": _coerce("microbatch", microbatch, MicrobatchConfig, MicrobatchConfig),
            "lora": _coerce("lora", lora, LoRAConfig, _lora_shorthand),
            "quantization": _coerce("quantization", quantization, QuantizationConfig, QuantizationConfig),
            "sharding": _coerce("sharding", sharding, ShardingConfig, ShardingConfig),
            "cross_entropy": _coerce("cross_entropy", cross_entropy, CrossEntropyConfig, _cross_entropy_shorthand),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    # read-only views in the flat vocabulary (what the shorthands set)
    @property
    def activation_checkpointing(self) -> Any:
        """The checkpointing policy, or ``None``."""
        return self.checkpointing.policy if self.checkpointing is not None else None

    @property
    def activation_compression(self) -> str | None:
        """The compression mode, or ``None``."""
        return self.compression.mode if self.compression is not None else None

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch size, or ``None`` (whole batches)."""
        return self.microbatch.size if self.microbatch is not None else None

    @property
    def optimizer_name(self) -> str | None:
        return self.optimizer.name if self.optimizer is not None else None

    @property
    def precision_preset(self) -> str | None:
        return self.precision.preset if self.precision is not None else None

    def replace(self, **changes: Any) -> "TrainingConfig":
        """A copy with some fields (or shorthands) changed, e.g. ``config.replace(micro_batch_size=2)``."""
        values: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for short, field in (("activation_checkpointing", "checkpointing"), ("activation_compression", "compression"),
                             ("micro_batch_size", "microbatch")):  # fmt: skip
            if short in changes:
                values[field] = None
        return TrainingConfig(**{**values, **changes})

    def describe(self) -> str:
        """A short human label, e.g. ``bf16-true + ckpt(auto) + int8 acts + adamw8bit + mb 4``."""
        parts = [self.precision.preset if self.precision is not None else "configured precision"]
        if self.lora is not None:
            parts.append(("q" if self.lora.quantize_base else "") + f"lora(r={self.lora.r})")
        if self.quantization is not None:
            parts.append(self.quantization.name)
        if self.checkpointing is not None:
            parts.append(f"ckpt({self.checkpointing.describe()})")
        if self.compression is not None:
            parts.append(f"{self.compression.mode} acts")
        if self.cross_entropy is not None:
            parts.append(f"{self.cross_entropy.mode} CE")
        parts.append(self.optimizer.name if self.optimizer is not None else "configured optimizer")
        if self.microbatch is not None:
            parts.append(f"mb {self.microbatch.size}")
        if self.sharding is not None:
            parts.append(f"{self.sharding.kind} x{self.sharding.world_size}")
        return " + ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The flat shorthands (JSON-friendly); ``TrainingConfig(**config.to_dict())`` rebuilds it. Settings
        at their defaults (compression ``min_bytes``, optimizer arguments, quantization, sharding) are left out."""
        policy = self.activation_checkpointing
        out: dict[str, Any] = {
            "precision": self.precision_preset,
            "activation_checkpointing": list(policy) if isinstance(policy, tuple) else policy,
            "activation_compression": self.activation_compression,
            "optimizer": self.optimizer_name,
            "micro_batch_size": self.micro_batch_size,
            "lora": {k: v for k, v in self.lora.kwargs().items() if getattr(LoRAConfig, k, None) != v or k == "r"}
            if self.lora is not None else None,
        }  # fmt: skip
        if self.checkpointing is not None and self.checkpointing.nested:
            out["nested_checkpointing"] = True
        if self.compression is not None and self.compression.min_bytes != DEFAULT_MIN_BYTES:
            out["compression_min_bytes"] = self.compression.min_bytes
        if self.optimizer is not None and self.optimizer.hyperparameters:
            out["optimizer_kwargs"] = self.optimizer.kwargs
        if self.quantization is not None:
            out["quantization"] = self.quantization.name
        if self.sharding is not None:
            out["sharding"], out["world_size"] = self.sharding.kind, self.sharding.world_size
        if self.cross_entropy is not None:
            defaults = CrossEntropyConfig(self.cross_entropy.mode)
            out["cross_entropy"] = (
                self.cross_entropy.mode if self.cross_entropy == defaults else dataclasses.asdict(self.cross_entropy)
            )
        return out
