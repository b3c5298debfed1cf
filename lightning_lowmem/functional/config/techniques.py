"""The per-technique configs: frozen dataclasses, each validated once in ``__post_init__`` (the torchao
pattern), with the argument, the value, what is allowed and a hint in every error."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from lightning_lowmem.functional.config.constants import (
    COMPRESSION_MIN_BYTES,
    COMPRESSION_MODES,
    GROUP_SIZE,
    QUANTIZATION_MODES,
)

__all__ = [
    "PRECISIONS",
    "SHARDINGS",
    "CROSS_ENTROPY_MODES",
    "CheckpointingConfig",
    "CompressionConfig",
    "CrossEntropyConfig",
    "LoRAConfig",
    "MicrobatchConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "QuantizationConfig",
    "ShardingConfig",
]

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
SHARDINGS = ("ddp", "zero1", "fsdp")
_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _did_you_mean(value: Any, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), allowed, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {type(value).__name__}: {value!r}")


def _hashable(value: Any) -> Any:
    """Lists (YAML's sequences) as tuples, so a config can be a dict key and compares by value."""
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


# ----------------------------------------------------------------------------- one config per technique
@dataclass(frozen=True)
class PrecisionConfig:
    """A Lightning precision preset.

    Args:
        preset: one of :data:`PRECISIONS`. Default: ``"32-true"``.

    Example::

        >>> PrecisionConfig("bf16-true").true_dtype
        torch.bfloat16
    """

    preset: str = "32-true"

    def __post_init__(self) -> None:
        if self.preset not in PRECISIONS:
            raise ValueError(
                f"`precision`={self.preset!r} is not a known preset; choose one of {list(PRECISIONS)}."
                + _did_you_mean(self.preset, PRECISIONS)
            )

    @property
    def true_dtype(self) -> torch.dtype | None:
        """The dtype parameters are held in (``"-true"`` half presets), else ``None``."""
        return _TRUE_DTYPES.get(self.preset)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype (``"-mixed"`` presets), else ``None``."""
        return _AUTOCAST_DTYPES.get(self.preset)


@dataclass(frozen=True)
class CheckpointingConfig:
    """Activation checkpointing (:func:`lightning_lowmem.functional.checkpointing.checkpoint_`).

    Args:
        policy: ``"auto"``, a class name, a module-name pattern, an every-k int, a module class, or a
            list of these (kept as a tuple). Default: ``"auto"``.
        nested: also wrap chosen modules inside other chosen ones. Default: ``False``.
    """

    policy: Any = "auto"
    nested: bool = False

    def __post_init__(self) -> None:
        from lightning_lowmem.functional.checkpointing import validate_policy as _validate_policy

        if isinstance(self.policy, list):
            object.__setattr__(self, "policy", tuple(self.policy))
        _validate_policy(self.policy)
        check_bool("nested", self.nested)

    def describe(self) -> str:
        policy = self.policy
        if isinstance(policy, tuple):
            return "[" + ", ".join(getattr(p, "__name__", str(p)) for p in policy) + "]"
        return getattr(policy, "__name__", str(policy))


@dataclass(frozen=True)
class CompressionConfig:
    """Activation compression (:func:`lightning_lowmem.functional.compression.compress_activations`).

    Args:
        mode: ``"bf16"``, ``"int8"`` or ``"cpu"``. Default: ``"int8"``.
        min_bytes: saved tensors smaller than this stay exact. Default: :data:`COMPRESSION_MIN_BYTES` (64 KiB).
    """

    mode: str = "int8"
    min_bytes: int = COMPRESSION_MIN_BYTES

    def __post_init__(self) -> None:
        if self.mode not in COMPRESSION_MODES:
            raise ValueError(
                f"`mode`={self.mode!r} is unknown; choose one of {list(COMPRESSION_MODES)} (or None: no compression)."
                + _did_you_mean(self.mode, COMPRESSION_MODES)
            )
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int):
            raise TypeError(
                f"`min_bytes` must be an int (bytes), got {type(self.min_bytes).__name__}: {self.min_bytes!r}"
            )
        if self.min_bytes < 0:
            raise ValueError(f"`min_bytes`={self.min_bytes} must be >= 0 (0 packs every float tensor)")


@dataclass(frozen=True, init=False)
class OptimizerConfig:
    """An optimizer from :func:`~lightning_lowmem.functional.optimizers.available_optimizers` and its
    hyperparameters, checked against the optimizer's signature and values at construction.

    Args:
        name: e.g. ``"adamw"``, ``"adamw8bit"``, ``"adafactor_in_backward"`` (case-insensitive).
            Default: ``"adamw"``.
        hyperparameters: a mapping (YAML) of arguments, merged with ``**kwargs``. Default: none.
        **kwargs: the optimizer's arguments (``lr``, ``weight_decay``, ``betas``, ``eps``, ...).

    Raises:
        ValueError: an unknown name or argument (with a did-you-mean), a value the optimizer refuses.

    Example::

        >>> config = OptimizerConfig("adamw8bit", lr=1e-3, betas=[0.9, 0.99])
        >>> config.kwargs
        {'betas': (0.9, 0.99), 'lr': 0.001}
    """

    name: str
    hyperparameters: tuple[tuple[str, Any], ...] | Mapping[str, Any]  # a mapping given, stored as sorted pairs

    def __init__(
        self, name: str = "adamw", hyperparameters: Mapping[str, Any] | tuple | None = None, **kwargs: Any
    ) -> None:
        from lightning_lowmem.functional.optimizers.catalog import check_optimizer_name, check_optimizer_kwargs

        key = check_optimizer_name(name)
        if hyperparameters is not None and not isinstance(hyperparameters, (Mapping, tuple)):
            raise ValueError(
                f"`optimizer_kwargs`={hyperparameters!r} must be a mapping of argument names to values, e.g. {{'lr': 1e-3}}"
            )
        merged = dict(hyperparameters or {})
        for argument, value in kwargs.items():
            if argument in merged and merged[argument] != value:
                raise ValueError(
                    f"`{argument}` is given twice ({merged[argument]!r} in optimizer_kwargs, {value!r}); give it once"
                )
            merged[argument] = value
        merged = {argument: _hashable(value) for argument, value in merged.items()}
        check_optimizer_kwargs(key, merged, owner=f"OptimizerConfig({key!r})")
        _check_optimizer_values(key, merged)
        object.__setattr__(self, "name", key)
        object.__setattr__(self, "hyperparameters", tuple(sorted(merged.items())))

    @property
    def kwargs(self) -> dict[str, Any]:
        """The hyperparameters as keyword arguments for ``build_optimizer``."""
        return dict(self.hyperparameters)

    @property
    def in_backward(self) -> bool:
        """It steps inside backward (``*_in_backward``)."""
        return self.name.endswith("_in_backward")

    def build(self, params: Any, **overrides: Any) -> torch.optim.Optimizer:
        """The optimizer over ``params``; ``overrides`` win over the hyperparameters (e.g. ``foreach``)."""
        from lightning_lowmem.functional.optimizers.catalog import build_optimizer

        return build_optimizer(self.name, params, **{**self.kwargs, **overrides})


_TORCHAO_BACKED = ("adamw8bit", "adamw4bit", "adamw_bf16_sr")


def _check_optimizer_values(name: str, kwargs: dict[str, Any]) -> None:
    """Refuse values the optimizer would refuse, now rather than when it is built."""
    from lightning_lowmem.functional.optimizers.catalog import build_optimizer

    for key in ("lr", "weight_decay", "momentum"):
        value = kwargs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0):
            raise ValueError(f"`{key}` must be a number >= 0, got {value!r}")
    betas = kwargs.get("betas")
    if betas is not None:
        if (
            not isinstance(betas, (tuple, list))
            or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)
        ):
            raise ValueError(f"`betas` must be two numbers in [0, 1), e.g. [0.9, 0.999], got {betas!r}")
    if not kwargs or name.removesuffix("_in_backward") in _TORCHAO_BACKED:
        return  # building a torchao optimizer imports torchao (slow, noisy on CPU): the checks above suffice
    probe = torch.nn.Parameter(torch.zeros(2, 2))
    try:
        optimizer = build_optimizer(name, [probe], **kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"OptimizerConfig({name!r}) refuses {kwargs}: {err}") from err
    if hasattr(optimizer, "remove_hooks"):
        optimizer.remove_hooks()


@dataclass(frozen=True)
class MicrobatchConfig:
    """Split each batch into micro-batches of ``size`` samples, accumulating gradients (same effective batch).

    Args:
        size: samples per micro-batch, >= 1.
    """

    size: int

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(
                f"`micro_batch_size` must be a positive int or None, got {self.size!r}; None starts with "
                "whole batches (AutoMicrobatch splits only after an out-of-memory error)."
            )

    def split(self, batch: Any) -> list[Any]:
        """``batch`` in micro-batches of :attr:`size` samples (:func:`~lightning_lowmem.functional.split_batch`)."""
        from lightning_lowmem.functional.microbatch import split_batch

        return split_batch(batch, self.size)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA / QLoRA adapters, the arguments of :func:`lightning_lowmem.functional.lora.apply_lora_`.

    Args:
        r: adapter rank, > 0. Default: 8.
        alpha: the update is scaled by ``alpha / r``. Default: 16.0.
        dropout: dropout on the adapters' input, in [0, 1). Default: 0.0.
        target: ``"all-linear"``, ``"all-conv"``, ``"all"``, a layer name pattern / class name, or a list of
            them (kept as a tuple). Default: ``"all-linear"``.
        quantize_base: ``None``, ``"nf4"``, ``"int8"`` or ``"int4"`` (QLoRA). Default: ``None``.
        quantize_frozen: with ``quantize_base``, also quantize the other frozen weights. Default: ``False``.
        freeze_base: freeze every non-adapter parameter. Default: ``True``.
        train_modules: modules trained in full beside the adapters (a fresh classification head): ``"auto"``
            (modules named ``classifier`` / ``score``), a name pattern or a list of them (kept as a tuple), or
            ``None``. Default: ``"auto"``.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target: Any = "all-linear"
    quantize_base: str | None = None
    quantize_frozen: bool = False
    freeze_base: bool = True
    train_modules: Any = "auto"

    def __post_init__(self) -> None:
        from lightning_lowmem.functional.lora.adapters import check_lora_arguments

        check_lora_arguments(self.r, self.alpha, self.dropout, self.quantize_base)
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))
        target = self.target
        if isinstance(target, (list, tuple)):
            if not target or not all(isinstance(t, (str, type)) for t in target):
                raise ValueError(
                    f"`target` must be a non-empty list of layer name patterns / class names, got {target!r}"
                )
            object.__setattr__(self, "target", tuple(target))
        elif not isinstance(target, (str, type)):
            raise ValueError(
                f"`target` must be 'all-linear', a layer name pattern or a list of them, got {type(target).__name__}: {target!r}"
            )
        check_bool("freeze_base", self.freeze_base)
        train = self.train_modules
        if isinstance(train, (list, tuple)) and all(isinstance(t, str) for t in train):
            object.__setattr__(self, "train_modules", tuple(train))
        elif not (train is None or isinstance(train, str)):
            raise ValueError(
                f"`train_modules` must be 'auto', None, a module name pattern or a list of them, got "
                f"{type(train).__name__}: {train!r}"
            )
        if not isinstance(self.quantize_frozen, bool) or (self.quantize_frozen and self.quantize_base is None):
            raise ValueError(
                f"`quantize_frozen`={self.quantize_frozen!r} must be a bool and needs `quantize_base` ('nf4', 'int8' or 'int4')."
            )

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``apply_lora_``."""
        values = dataclasses.asdict(self)
        values["target"] = list(self.target) if isinstance(self.target, tuple) else self.target
        if isinstance(self.train_modules, tuple):
            values["train_modules"] = list(self.train_modules)
        return values


@dataclass(frozen=True, eq=False)
class QuantizationConfig:
    """Weight quantization: a mode name of :data:`~lightning_lowmem.functional.config.QUANTIZATION_MODES` or a
    torchao config object (e.g. ``Int8WeightOnlyConfig(group_size=64)``).

    The one place a quantization mode and a group size are checked: ``quantize_``, ``quantizable_layers``,
    ``PostTrainingQuantization`` and :class:`~lightning_lowmem.functional.config.QATConfig` build one.

    Args:
        mode: the mode name or the torchao config. Two configs are equal when their names (or the torchao
            configs' ``repr``) are. Default: ``"int8_weight_only"``.
        group_size: group length of the grouped (int4) modes, an int >= 1.
            Default: :data:`~lightning_lowmem.functional.config.GROUP_SIZE` (32).

    Raises:
        ValueError: an unknown mode name (with a did-you-mean), a bad ``group_size``.
        TypeError: ``mode`` neither a name nor a torchao config object.

    Example::

        >>> QuantizationConfig("intx4_weight_only", group_size=64).grouped
        True
        >>> QuantizationConfig("int8_weight_onyl")
        Traceback (most recent call last):
        ...
        ValueError: `mode`='int8_weight_onyl' is not a known quantization mode; ... Did you mean 'int8_weight_only'?
    """

    mode: Any = "int8_weight_only"
    group_size: int = GROUP_SIZE

    def __post_init__(self) -> None:
        if isinstance(self.mode, str):
            if self.mode not in QUANTIZATION_MODES:
                raise ValueError(
                    f"`mode`={self.mode!r} is not a known quantization mode; choose one of {list(QUANTIZATION_MODES)} "
                    f"or pass a torchao config object.{_did_you_mean(self.mode, tuple(QUANTIZATION_MODES))}"
                )
        elif not type(self.mode).__module__.startswith("torchao"):
            raise TypeError(
                f"`quantization` must be a mode name or a torchao config object (e.g. torchao.quantization."
                f"Int8WeightOnlyConfig()), got {type(self.mode).__name__}: {self.mode!r}"
            )
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"`group_size` must be a positive int (e.g. 32, 64, 128), got {self.group_size!r}")

    @property
    def name(self) -> str:
        return self.mode if isinstance(self.mode, str) else type(self.mode).__name__

    @property
    def grouped(self) -> bool:
        """The mode stores int4 values in groups of ``group_size`` inputs (a layer's width must divide)."""
        return self.mode in ("int4_weight_only", "intx4_weight_only")

    def _key(self) -> tuple:
        return (self.mode if isinstance(self.mode, str) else repr(self.mode), self.group_size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QuantizationConfig) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @classmethod
    def of(cls, mode: Any, group_size: int = GROUP_SIZE) -> QuantizationConfig:
        """``mode`` itself when it is a config, else ``QuantizationConfig(mode, group_size)``: how the functional
        entry points take a config or its flat shorthand (``quantize_(model, "int8_weight_only", group_size=64)``).

        Raises:
            ValueError: ``group_size`` given beside a config (set it in the config), and the config's own checks.
        """
        if not isinstance(mode, QuantizationConfig):
            return cls(mode, group_size)
        if group_size != GROUP_SIZE and group_size != mode.group_size:
            raise ValueError(f"`group_size`={group_size!r} is given beside a QuantizationConfig; set it in the config")
        return mode

    def mode_name(self, owner: str) -> str:
        """``mode`` as a name, for the entry points that dispatch on it.

        Raises:
            TypeError: ``mode`` is a torchao config object, which ``owner`` cannot run.
        """
        if not isinstance(self.mode, str):
            raise TypeError(
                f"{owner} takes a mode name of {list(QUANTIZATION_MODES)}, got the torchao config {self.mode!r}; "
                "apply it with torchao.quantization.quantize_(model, config)"
            )
        return self.mode

    def torchao_config(self) -> Any:
        """The torchao config this stands for."""
        if not isinstance(self.mode, str):
            return self.mode
        from lightning_lowmem.functional.quantization.modes import torchao_config

        return torchao_config(self.mode, group_size=self.group_size)


@dataclass(frozen=True)
class ShardingConfig:
    """How the step is spread over processes.

    Args:
        kind: ``"ddp"`` (every rank holds everything), ``"zero1"`` (optimizer state sharded) or ``"fsdp"``
            (parameters, gradients and state sharded). Default: ``"ddp"``.
        world_size: number of processes, >= 1. Default: 1.
    """

    kind: str = "ddp"
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SHARDINGS:
            raise ValueError(
                f"`sharding`={self.kind!r} is unknown; choose None, 'ddp', 'zero1' or 'fsdp'.{_did_you_mean(self.kind, SHARDINGS)}"
            )
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(
                f"`world_size`={self.world_size!r} must be an int >= 1: the number of processes (GPUs) the step "
                "runs on, e.g. world_size=8, sharding='fsdp'"
            )


CROSS_ENTROPY_MODES = ("chunked",)


@dataclass(frozen=True)
class CrossEntropyConfig:
    """The output head's loss computed in chunks of tokens: the ``(tokens, vocabulary)`` logits never exist
    whole in training (:func:`lightning_lowmem.functional.cross_entropy.chunk_cross_entropy_`).

    Args:
        mode: ``"chunked"`` (the one mode). Default: ``"chunked"``.
        chunk_size: tokens per chunk, >= 1. Default: ``None`` (a chunk's logits at most 1/8 of the whole, 32 MiB).
        head: the output head's module name, when it is not found (a Hugging Face model's
            ``get_output_embeddings()``, an ``nn.Linear`` named ``lm_head`` / ``output``). Default: ``None``.
        kernel: ``"auto"`` / ``"lowmem"`` / ``"liger"`` / ``"cce"`` (:mod:`.cross_entropy.kernels`). Default: ``"auto"``.

    Example::

        >>> CrossEntropyConfig(chunk_size=1024)
        CrossEntropyConfig(mode='chunked', chunk_size=1024, head=None, kernel='auto')
    """

    mode: str = "chunked"
    chunk_size: int | None = None
    head: str | None = None
    kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in CROSS_ENTROPY_MODES:
            raise ValueError(
                f"`cross_entropy`={self.mode!r} is unknown; choose None (the model's own loss) or 'chunked'."
                + _did_you_mean(self.mode, CROSS_ENTROPY_MODES)
            )
        from lightning_lowmem.functional.cross_entropy.kernels import check_kernel  # one list of kernels, one message

        check_kernel(self.kernel)
        size = self.chunk_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(
                f"`chunk_size`={size!r} must be a positive int (tokens per chunk) or None for the default "
                "(a chunk's logits at most 1/8 of the whole)"
            )
        if self.head is not None and (not isinstance(self.head, str) or not self.head):
            raise ValueError(f"`head`={self.head!r} must be the output head's module name ('model.lm_head') or None")
