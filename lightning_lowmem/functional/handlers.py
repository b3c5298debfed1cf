"""The built-in techniques: for each config of :mod:`lightning_lowmem.functional.config`, the handler that
:func:`~lightning_lowmem.functional.apply` runs, and the shorthands :class:`TrainingConfig` takes for it. The
techniques added since live in one module each, in :mod:`lightning_lowmem.functional.techniques` (registered after
these, found by file).

Registered in ``describe()`` order; applied in their registered ``order``, which is written here once (the
doctest below reads this module's techniques from the registry): a one-shot prune first, then quantization, QAT's
fake quantizers, LoRA (adapters on the possibly quantized layers), activation checkpointing (wrapping whole blocks,
adapters included), the chunked cross-entropy, and the KV-cache hold activation compression needs; a technique of
:mod:`~lightning_lowmem.functional.techniques` takes its place between them by its own ``order``::

    >>> from lightning_lowmem.functional.registry import techniques
    >>> built_in = [t for t in techniques() if t.handler.__module__ == __name__]  # describe() / to_dict() order
    >>> [t.field for t in built_in]
    ['precision', 'lora', 'quantization', 'checkpointing', 'compression', 'cross_entropy', 'optimizer', 'microbatch', 'sharding', 'pruning', 'qat']
    >>> [(t.field, t.order) for t in sorted(built_in, key=lambda t: t.order) if t.order]  # apply() order
    [('pruning', 5), ('quantization', 10), ('qat', 15), ('lora', 20), ('checkpointing', 30), ('cross_entropy', 40), ('compression', 50)]

Precision, the optimizer, micro-batching and sharding change
nothing in the module (order 0): their step-side part is their config's (``OptimizerConfig.build``,
``MicrobatchConfig.split``) or their registered ``step_context`` (activation compression's
``compress_activations``), and precision is the precision plugin's (Lightning's, or the estimator's fake copy).
``ScheduledPruning`` and ``QuantizationAwareTraining`` decide *when* (a sparsity schedule over steps, the
conversion at the end of fit); ``apply`` with a ``PruningConfig`` / ``QATConfig`` is the one-shot form.

Example::

    >>> from lightning_lowmem.functional.config import LoRAConfig
    >>> from lightning_lowmem.functional.registry import handler_for
    >>> handler_for(LoRAConfig).__name__
    '_lora'
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from torch import nn

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
    check_bool,
)
from lightning_lowmem.functional.config.constants import COMPRESSION_MIN_BYTES
from lightning_lowmem.functional.config.pruning import PruningConfig
from lightning_lowmem.functional.config.qat import QATConfig
from lightning_lowmem.functional.registry import register_technique

__all__ = ["restore_point"]  # the handlers themselves are found through the registry

_COMPRESSION = "activation compression"  # the reason activation compression holds the KV cache off


@dataclass
class _Structure:
    """Which children and parameters every submodule had, and which parameters required gradients."""

    children: dict[nn.Module, list[tuple[str, nn.Module]]]
    parameters: dict[nn.Module, list[tuple[str, nn.Parameter | None]]]
    requires_grad: dict[nn.Parameter, bool]
    nested_tensor: dict[nn.Module, bool] = field(default_factory=dict)  # nn.TransformerEncoder's, which LoRA turns off

    @classmethod
    def of(cls, module: nn.Module) -> "_Structure":
        modules = list(module.modules())
        return cls(
            children={m: list(m.named_children()) for m in modules},
            parameters={m: list(m.named_parameters(recurse=False)) for m in modules},
            requires_grad={p: p.requires_grad for p in module.parameters()},
            nested_tensor={m: m.use_nested_tensor for m in modules if isinstance(m, nn.TransformerEncoder)},
        )

    def restore(self) -> None:
        for owner, children in self.children.items():
            kept = {name for name, _ in children}
            for name, _ in list(owner.named_children()):
                if name not in kept:
                    delattr(owner, name)
            for name, child in children:
                setattr(owner, name, child)
        for owner, parameters in self.parameters.items():
            for name, param in parameters:
                setattr(owner, name, param)
        for param, requires_grad in self.requires_grad.items():
            param.requires_grad_(requires_grad)
        for encoder, nested in self.nested_tensor.items():
            encoder.use_nested_tensor = nested


def restore_point(module: nn.Module) -> Callable[[], None]:
    """How to give ``module`` back its structure as it is now: every submodule, parameter object and
    ``requires_grad`` flag (what a transform that swaps layers, e.g. ``prepare_qat_``, changes)."""
    return _Structure.of(module).restore


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


def _one_of(field: str, value: Any, short: str, alias: Any) -> Any:
    """``value`` or its alias ``short`` (``micro_batch_size`` for ``microbatch``), refusing both."""
    if alias is not None and value is not None:
        raise ValueError(f"`{short}`={alias!r} and `{field}`={value!r} set the same technique; give one")
    return value if value is not None else alias


def _nothing(module: nn.Module, config: Any, applied: Any) -> None:
    """A step-side technique: nothing to do to the module."""


# ----------------------------------------------------------------------------- precision
register_technique(
    PrecisionConfig,
    field="precision",
    order=0,
    default="32-true",
    label=lambda c: c.preset if c is not None else "configured precision",
    to_shorthand=lambda c: {"precision": c.preset if c is not None else None},
)(_nothing)


# ----------------------------------------------------------------------------- LoRA
def _lora_shorthand(value: Any) -> Any:
    if value is None or isinstance(value, (LoRAConfig, Mapping)):
        return value
    if isinstance(value, tuple) and all(isinstance(item, tuple) and len(item) == 2 for item in value):
        return dict(value)  # the (key, value) pairs earlier versions stored
    if isinstance(value, int) and not isinstance(value, bool):
        return LoRAConfig(r=value)
    raise TypeError(
        f"`lora`={value!r} must be a LoRAConfig, a mapping of apply_lora_ arguments (e.g. {{'r': 8}}) or None"
    )


def _lora_to_shorthand(config: LoRAConfig | None) -> dict[str, Any]:
    if config is None:
        return {"lora": None}
    return {"lora": {k: v for k, v in config.kwargs().items() if getattr(LoRAConfig, k, None) != v or k == "r"}}


@register_technique(
    LoRAConfig,
    field="lora",
    order=20,
    shorthand=_lora_shorthand,
    label=lambda c: None if c is None else ("q" if c.quantize_base else "") + f"lora(r={c.r})",
    to_shorthand=_lora_to_shorthand,
)
def _lora(module: nn.Module, config: LoRAConfig, applied: Any) -> None:
    from lightning_lowmem.functional.lora.adapters import apply_lora_

    applied.on_undo(_Structure.of(module).restore)
    applied.reports["lora"] = apply_lora_(module, **config.kwargs())


# ----------------------------------------------------------------------------- quantization
def _quantization_to_shorthand(config: QuantizationConfig | None) -> dict[str, Any]:
    if config is None:
        return {}
    if config.group_size == QuantizationConfig.group_size or not isinstance(config.mode, str):
        return {"quantization": config.name}  # a torchao config object is named (JSON-friendly), not rebuilt
    return {"quantization": {"mode": config.mode, "group_size": config.group_size}}


@register_technique(
    QuantizationConfig,
    field="quantization",
    order=10,
    label=lambda c: c.name if c is not None else None,
    to_shorthand=_quantization_to_shorthand,
)
def _quantization(module: nn.Module, config: QuantizationConfig, applied: Any) -> None:
    if config.mode == "int8_static":
        raise ValueError(
            "`quantization`='int8_static' needs calibration data and builds a new module: use "
            "lightning_lowmem.functional.quantize_static (or the PostTrainingQuantization callback)"
        )
    applied.on_undo(_Structure.of(module).restore)
    if isinstance(config.mode, str):
        from lightning_lowmem.functional.quantization.ptq import quantize_

        applied.reports["quantization"] = quantize_(module, config.mode, group_size=config.group_size)
        return
    from torchao.quantization import quantize_ as torchao_quantize_

    torchao_quantize_(module, config.mode)


# ----------------------------------------------------------------------------- activation checkpointing
def _checkpointing_shorthand(
    value: Any, *, activation_checkpointing: Any = None, nested_checkpointing: bool | None = None
) -> Any:
    value = _one_of("checkpointing", value, "activation_checkpointing", activation_checkpointing)
    if nested_checkpointing is not None:
        check_bool("nested_checkpointing", nested_checkpointing)
        if value is None and nested_checkpointing:
            raise ValueError("`nested_checkpointing`=True needs `activation_checkpointing` (a policy to nest)")
    if value is None or isinstance(value, (CheckpointingConfig, Mapping)):
        return value
    with _named(policy="activation_checkpointing", nested="nested_checkpointing"):
        return CheckpointingConfig(value, nested=bool(nested_checkpointing))


def _checkpointing_to_shorthand(config: CheckpointingConfig | None) -> dict[str, Any]:
    if config is None:
        return {"activation_checkpointing": None}
    policy = list(config.policy) if isinstance(config.policy, tuple) else config.policy
    return {"activation_checkpointing": policy, **({"nested_checkpointing": True} if config.nested else {})}


@register_technique(
    CheckpointingConfig,
    field="checkpointing",
    order=30,
    shorthand=_checkpointing_shorthand,
    label=lambda c: f"ckpt({c.describe()})" if c is not None else None,
    to_shorthand=_checkpointing_to_shorthand,
)
def _checkpointing(module: nn.Module, config: CheckpointingConfig, applied: Any) -> None:
    from lightning_lowmem.functional.checkpointing import checkpoint_, uncheckpoint_

    def undo() -> None:
        if applied.reports.get("checkpointing"):
            uncheckpoint_(module, applied.reports["checkpointing"])
            applied.reports["checkpointing"] = []

    applied.on_undo(undo)
    policy = list(config.policy) if isinstance(config.policy, tuple) else config.policy
    applied.reports["checkpointing"] = checkpoint_(module, policy, nested=config.nested, strict=applied.strict).wrapped


# ----------------------------------------------------------------------------- activation compression
def _compression_shorthand(
    value: Any, *, activation_compression: str | None = None, compression_min_bytes: int | None = None
) -> Any:
    value = _one_of("compression", value, "activation_compression", activation_compression)
    if value is None or isinstance(value, (CompressionConfig, Mapping)):
        return value
    min_bytes = COMPRESSION_MIN_BYTES if compression_min_bytes is None else compression_min_bytes
    with _named(mode="activation_compression", min_bytes="compression_min_bytes"):
        return CompressionConfig(value, min_bytes=min_bytes)


def _compression_to_shorthand(config: CompressionConfig | None) -> dict[str, Any]:
    if config is None:
        return {"activation_compression": None}
    out: dict[str, Any] = {"activation_compression": config.mode}
    if config.min_bytes != COMPRESSION_MIN_BYTES:
        out["compression_min_bytes"] = config.min_bytes
    return out


@register_technique(
    CompressionConfig,
    field="compression",
    order=50,
    shorthand=_compression_shorthand,
    label=lambda c: f"{c.mode} acts" if c is not None else None,
    to_shorthand=_compression_to_shorthand,
    step_context=lambda config, stats: _compress_activations(config, stats),
)
def _compression(module: nn.Module, config: CompressionConfig, applied: Any) -> None:
    """The step side is :func:`_compress_activations`; here, the hold on a Hugging Face model's training-time KV
    cache, which keeps keys / values whole (what compression cannot pack)."""
    from lightning_lowmem.functional.compression import CompressionStats

    applied.reports["compression"] = CompressionStats()
    if not applied.hold_kv_cache:
        return
    from lightning_lowmem.model_io import disable_kv_cache_, restore_kv_cache_

    applied.on_undo(lambda: restore_kv_cache_(module, _COMPRESSION))
    disable_kv_cache_(module, _COMPRESSION)


def _compress_activations(config: CompressionConfig, stats: Any) -> Any:
    from lightning_lowmem.functional.compression import compress_activations

    return compress_activations(config, stats=stats)


# ----------------------------------------------------------------------------- the chunked cross-entropy
def _cross_entropy_shorthand(value: Any) -> Any:
    if value is None or isinstance(value, (CrossEntropyConfig, Mapping)):
        return value
    if isinstance(value, str):
        return CrossEntropyConfig(value)
    raise TypeError(
        f"`cross_entropy`={value!r} must be 'chunked', a CrossEntropyConfig, a mapping of its arguments "
        "(e.g. {'chunk_size': 1024}) or None"
    )


def _cross_entropy_to_shorthand(config: CrossEntropyConfig | None) -> dict[str, Any]:
    if config is None:
        return {}
    default = config == CrossEntropyConfig(config.mode)
    return {"cross_entropy": config.mode if default else dataclasses.asdict(config)}


@register_technique(
    CrossEntropyConfig,
    field="cross_entropy",
    order=40,
    shorthand=_cross_entropy_shorthand,
    label=lambda c: f"{c.mode} CE" if c is not None else None,
    to_shorthand=_cross_entropy_to_shorthand,
)
def _cross_entropy(module: nn.Module, config: CrossEntropyConfig, applied: Any) -> None:
    from lightning_lowmem.functional.cross_entropy.models import chunk_cross_entropy_

    def undo() -> None:
        if applied.reports.get("cross_entropy") is not None:
            applied.reports.pop("cross_entropy").undo()

    applied.on_undo(undo)
    applied.reports["cross_entropy"] = chunk_cross_entropy_(
        module, chunk_size=config.chunk_size, head=config.head, kernel=config.kernel
    )


# ----------------------------------------------------------------------------- the optimizer
def _optimizer_shorthand(value: Any, *, optimizer_kwargs: Mapping[str, Any] | None = None) -> Any:
    if not optimizer_kwargs:
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"`optimizer_kwargs`={dict(optimizer_kwargs)!r} needs `optimizer` as a name, got {value!r}; "
            "give the arguments to OptimizerConfig instead"
        )
    return OptimizerConfig(value, optimizer_kwargs)


def _optimizer_to_shorthand(config: OptimizerConfig | None) -> dict[str, Any]:
    if config is None:
        return {"optimizer": None}
    return {"optimizer": config.name, **({"optimizer_kwargs": config.kwargs} if config.hyperparameters else {})}


register_technique(
    OptimizerConfig,
    field="optimizer",
    order=0,
    default="adamw",
    shorthand=_optimizer_shorthand,
    label=lambda c: c.name if c is not None else "configured optimizer",
    to_shorthand=_optimizer_to_shorthand,
)(_nothing)


# ----------------------------------------------------------------------------- micro-batches
def _microbatch_shorthand(value: Any, *, micro_batch_size: int | None = None) -> Any:
    return _one_of("microbatch", value, "micro_batch_size", micro_batch_size)


register_technique(
    MicrobatchConfig,
    field="microbatch",
    order=0,
    shorthand=_microbatch_shorthand,
    label=lambda c: f"mb {c.size}" if c is not None else None,
    to_shorthand=lambda c: {"micro_batch_size": c.size if c is not None else None},
)(_nothing)


# ----------------------------------------------------------------------------- sharding
def _sharding_shorthand(value: Any, *, world_size: int | None = None) -> Any:
    if isinstance(value, str) or (value is None and world_size not in (None, 1)):
        return ShardingConfig(value or "ddp", world_size if world_size is not None else 1)
    if world_size is not None and world_size != getattr(value, "world_size", 1):
        raise ValueError(f"`world_size`={world_size!r} disagrees with `sharding`={value!r}; give it once")
    return value


register_technique(
    ShardingConfig,
    field="sharding",
    order=0,
    shorthand=_sharding_shorthand,
    label=lambda c: f"{c.kind} x{c.world_size}" if c is not None else None,
    to_shorthand=lambda c: {"sharding": c.kind, "world_size": c.world_size} if c is not None else {},
)(_nothing)


# ----------------------------------------------------------------------------- pruning (one shot)
def _changed_fields(field: str) -> Any:
    """``to_dict()``'s entry for a config: the arguments that differ from their defaults (they rebuild it)."""

    def to_shorthand(config: Any) -> dict[str, Any]:
        if config is None:
            return {}
        fields = dataclasses.fields(config)
        return {field: {f.name: getattr(config, f.name) for f in fields if getattr(config, f.name) != f.default}}

    return to_shorthand


def _is_real(tensor: Any) -> bool:
    """A tensor with values to keep (not the estimator's fake or meta copy, whose undo restores nothing)."""
    return tensor.device.type != "meta" and type(tensor).__name__ != "FakeTensor"


@register_technique(
    PruningConfig,
    field="pruning",
    order=5,
    label=lambda c: None if c is None else f"prune({c.method or c.pruning_fn} {c.final_sparsity})",
    to_shorthand=_changed_fields("pruning"),
    not_estimated="which weights it prunes depends on their values, which fake tensors do not have (its masks add "
    "1 byte per pruned weight)",
)
def _pruning(module: nn.Module, config: PruningConfig, applied: Any) -> None:
    """Prune once to the config's final sparsity (``ScheduledPruning`` schedules it over training): bool masks as
    ``<name>_mask`` buffers, the pruned weights zeroed (call ``apply_masks_`` after each optimizer step to keep
    them zero). Undo puts the pruned values back and drops the masks; to do so the values of the pruned tensors
    are copied once before pruning (the estimator's fake copy keeps none)."""
    import torch

    from lightning_lowmem.functional.pruning.masks import MASK_SUFFIX, get_mask
    from lightning_lowmem.functional.pruning.unstructured import prune_

    owners = [(sub, name) for sub in module.modules() for name, _ in sub.named_parameters(recurse=False)]
    had_mask = {(id(sub), name) for sub, name in owners if get_mask(sub, name) is not None}
    originals = {}  # parameter id -> its values before pruning (a tied parameter once)
    for sub, name in owners:
        param = getattr(sub, name)
        if _is_real(param) and id(param) not in originals:
            originals[id(param)] = param.detach().clone()
    kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def undo() -> None:
        with torch.no_grad():
            for param, mask, values in kept:
                param[~mask] = values
        for sub, name in owners:
            if (id(sub), name) not in had_mask and get_mask(sub, name) is not None:
                delattr(sub, name + MASK_SUFFIX)

    applied.on_undo(undo)
    applied.reports["pruning"] = prune_(module, config)
    done: set[int] = set()
    for sub, name in owners:
        param, mask = getattr(sub, name), get_mask(sub, name)
        if mask is not None and id(param) in originals and id(param) not in done:
            kept.append((param.detach(), mask, originals[id(param)][~mask]))
            done.add(id(param))
    originals.clear()  # only the pruned values are kept


# ----------------------------------------------------------------------------- quantization-aware training
def _qat_shorthand(value: Any) -> Any:
    return QATConfig(value) if isinstance(value, str) else value


@register_technique(
    QATConfig,
    field="qat",
    order=15,
    shorthand=_qat_shorthand,
    label=lambda c: None if c is None else f"qat({c.mode})",
    to_shorthand=_changed_fields("qat"),
)
def _qat(module: nn.Module, config: QATConfig, applied: Any) -> None:
    """Fake-quantize the chosen layers (``prepare_qat_``); ``convert_qat_`` after training turns them into the
    quantized model. Undo gives back the float layers."""
    from lightning_lowmem.functional.quantization.qat import prepare_qat_

    applied.on_undo(_Structure.of(module).restore)
    applied.reports["qat"] = prepare_qat_(module, config)
