"""`apply`: a :class:`~lightning_lowmem.functional.config.TrainingConfig` on a module, with an undo handle.

One function turns a technique mix into a transformed module, an optimizer and a step context. The
callbacks, the low-memory strategies and the estimator (on its fake copy) all go through it, so what is
planned is what runs:

* model side, in place: quantization, LoRA adapters, activation checkpointing, the chunked cross-entropy
  (the output head defers its logits in training), and the hold on a Hugging Face model's training-time KV
  cache that activation compression needs (checkpointing holds it itself);
* per step: :meth:`Applied.step_context` (activation compression), :meth:`Applied.micro_batches`;
* the optimizer: :meth:`Applied.build_optimizer` from the config's :class:`OptimizerConfig`, or
  :func:`lightning_lowmem.functional.optimizers.convert.convert_optimizer` for one already built.

Precision is not applied here: a ``"-true"`` preset is the precision plugin's cast (Lightning's, or the
estimator's fake copy in that dtype), a ``"-mixed"`` one autocast around the step.

Example::

    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> applied = apply(model, TrainingConfig(lora={"r": 2, "target": ["0", "2"]}, optimizer="sgd"))
    >>> type(model[0]).__name__, [name for name, p in model.named_parameters() if p.requires_grad]
    ('LoraLinear', ['0.lora_A', '0.lora_B', '2.lora_A', '2.lora_B'])
    >>> applied.undo()
    >>> type(model[0]).__name__, [name for name, p in model.named_parameters() if p.requires_grad]
    ('Linear', ['0.weight', '0.bias', '2.weight', '2.bias'])
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterable

import torch
from torch import nn

from lightning_lowmem.functional.config import TrainingConfig

__all__ = ["Applied", "apply", "step_context"]

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


@dataclass
class Applied:
    """What :func:`apply` did to a module, what a step needs, and how to undo it.

    Attributes:
        module: the transformed module.
        config: the applied config.
        checkpointed: names of the submodules wrapped with activation checkpointing.
        lora: the :class:`~lightning_lowmem.functional.lora.LoraReport`, or ``None``.
        quantization: the quantization report, or ``None``.
        cross_entropy: the :class:`~lightning_lowmem.functional.cross_entropy.ChunkedLoss` (heads deferred,
            losses routed), or ``None``.
        compression_stats: the activation-compression figures of the steps run in :meth:`step_context`.
    """

    module: nn.Module = field(repr=False)
    config: TrainingConfig
    checkpointed: list[str] = field(default_factory=list)
    lora: Any = None
    quantization: Any = None
    cross_entropy: Any = None
    compression_stats: Any = None
    _structure: _Structure | None = field(default=None, repr=False)
    _kv_cache_held: bool = field(default=False, repr=False)
    _undone: bool = field(default=False, repr=False)

    def step_context(self, stats: Any = None) -> ContextManager[Any]:
        """The context a training step (forward and backward) runs in: activation compression, or nothing.

        Args:
            stats: a :class:`~lightning_lowmem.functional.compression.CompressionStats` to add this step's
                figures to. Default: :attr:`compression_stats`.
        """
        return step_context(self.config, stats or self.compression_stats)

    def micro_batches(self, batch: Any) -> list[Any]:
        """``batch`` split as the config's micro-batch size says (``[batch]`` without micro-batches)."""
        if self.config.microbatch is None:
            return [batch]
        from lightning_lowmem.functional.microbatch import split_batch

        return split_batch(batch, self.config.microbatch.size)

    def build_optimizer(self, params: Iterable[Any] | None = None, **overrides: Any) -> torch.optim.Optimizer:
        """The config's optimizer over ``params`` (default: the module's trainable parameters); ``overrides``
        win over the config's hyperparameters (e.g. ``foreach`` for a device)."""
        from lightning_lowmem.functional.optimizers.registry import build_optimizer

        optimizer = self.config.optimizer
        if optimizer is None:
            raise ValueError("`config.optimizer` is None (the configured optimizer): there is no optimizer to build")
        if params is None:
            params = [p for p in self.module.parameters() if p.requires_grad]
        return build_optimizer(optimizer.name, params, **{**optimizer.kwargs, **overrides})

    def undo(self) -> None:
        """Give the module back as it was: checkpointing unwrapped, adapters / quantized weights replaced by
        the original submodules and parameters, ``requires_grad`` and the KV cache restored (idempotent)."""
        if self._undone:
            return
        if self.cross_entropy is not None:
            self.cross_entropy.undo()
            self.cross_entropy = None
        if self.checkpointed:
            from lightning_lowmem.functional.checkpointing import uncheckpoint_

            uncheckpoint_(self.module, self.checkpointed)
            self.checkpointed = []
        if self._structure is not None:
            self._structure.restore()
            self._structure = None
        if self._kv_cache_held:
            from lightning_lowmem.model_io import restore_kv_cache_

            restore_kv_cache_(self.module, _COMPRESSION)
            self._kv_cache_held = False
        self._undone = True


def apply(
    module: nn.Module,
    config: TrainingConfig | dict[str, Any],
    *,
    strict: bool = True,
    hold_kv_cache: bool = True,
) -> Applied:
    """Apply ``config``'s model-side techniques to ``module``, in place; return the handle that undoes them.

    Order: quantization, LoRA (adapters on the possibly quantized layers), activation checkpointing
    (wrapping whole blocks, adapters included), the chunked cross-entropy (the output head's forward and a
    Hugging Face causal LM's loss), then the KV-cache hold for activation compression.

    Args:
        module: any ``nn.Module`` (real, meta or fake parameters).
        config: a :class:`TrainingConfig`, or a dict of its shorthands (``{"lora": {"r": 8}}``).
        strict: a checkpointing policy that matches nothing raises (``False``: it warns). Default: ``True``.
        hold_kv_cache: switch a Hugging Face model's ``config.use_cache`` off while compression runs (what a
            training-time KV cache keeps, compression cannot pack). Default: ``True``.

    Returns:
        An :class:`Applied`; ``applied.undo()`` restores the module (state dict keys and values, module
        types, ``requires_grad``, ``use_cache``).

    Raises:
        ValueError / TypeError: the config is invalid, or a technique cannot apply (a LoRA target or a
            checkpointing policy that matches nothing, ``"int8_static"`` quantization, which needs
            calibration data: use ``quantize_static``), a chunked cross-entropy with no output head to find.
    """
    if isinstance(config, dict):
        config = TrainingConfig(**config)
    if not isinstance(config, TrainingConfig):
        raise TypeError(f"`config` must be a TrainingConfig or a dict of its arguments, got {type(config).__name__}")
    applied = Applied(module, config)
    if config.compression is not None:
        from lightning_lowmem.functional.compression import CompressionStats

        applied.compression_stats = CompressionStats()
    if config.quantization is not None or config.lora is not None:
        applied._structure = _Structure.of(module)
    try:
        if config.quantization is not None:
            applied.quantization = _quantize(module, config)
        if config.lora is not None:
            from lightning_lowmem.functional.lora.adapters import apply_lora_

            applied.lora = apply_lora_(module, **config.lora.kwargs())
        if config.checkpointing is not None:
            from lightning_lowmem.functional.checkpointing import checkpoint_

            checkpointing = config.checkpointing
            policy = list(checkpointing.policy) if isinstance(checkpointing.policy, tuple) else checkpointing.policy
            applied.checkpointed = checkpoint_(module, policy, nested=checkpointing.nested, strict=strict).wrapped
        if config.cross_entropy is not None:
            from lightning_lowmem.functional.cross_entropy.models import chunk_cross_entropy_

            loss = config.cross_entropy
            applied.cross_entropy = chunk_cross_entropy_(module, chunk_size=loss.chunk_size, head=loss.head)
        if config.compression is not None and hold_kv_cache:
            from lightning_lowmem.model_io import disable_kv_cache_

            disable_kv_cache_(module, _COMPRESSION)  # a training-time KV cache keeps keys / values whole
            applied._kv_cache_held = True
    except BaseException:
        applied.undo()  # a technique that failed leaves the module as it came
        raise
    return applied


def step_context(config: TrainingConfig, stats: Any = None) -> ContextManager[Any]:
    """The context ``config``'s training step runs in: activation compression (adding to ``stats``), or nothing."""
    compression = config.compression
    if compression is None:
        return contextlib.nullcontext()
    from lightning_lowmem.functional.compression import compress_activations

    return compress_activations(compression.mode, compression.min_bytes, stats)


def _quantize(module: nn.Module, config: TrainingConfig) -> Any:
    quantization = config.quantization
    assert quantization is not None
    if isinstance(quantization.mode, str):
        if quantization.mode == "int8_static":
            raise ValueError(
                "`quantization`='int8_static' needs calibration data and builds a new module: use "
                "lightning_lowmem.functional.quantize_static (or the PostTrainingQuantization callback)"
            )
        from lightning_lowmem.functional.quantization.ptq import quantize_

        return quantize_(module, quantization.mode, group_size=quantization.group_size)
    from torchao.quantization import quantize_ as torchao_quantize_

    torchao_quantize_(module, quantization.mode)
    return None
