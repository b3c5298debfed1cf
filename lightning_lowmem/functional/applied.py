"""`apply`: technique configs on a module, with an undo handle.

One function turns a technique mix (a :class:`~lightning_lowmem.functional.config.TrainingConfig`, or one
technique's config, or a list of them) into a transformed module, an optimizer and a step context. It calls
the handler :mod:`lightning_lowmem.functional.registry` holds for each config, in the registered order. The
callbacks, the low-memory strategies and the estimator (on its fake copy) all go through it, so what is
planned is what runs:

* model side, in place: quantization, LoRA adapters, activation checkpointing, the chunked cross-entropy
  (the output head defers its logits in training), and the hold on a Hugging Face model's training-time KV
  cache that activation compression needs (checkpointing holds it itself);
* per step: :meth:`Applied.step_context` (every registered technique's ``step_context``: activation compression),
  :meth:`Applied.micro_batches` (``MicrobatchConfig.split``);
* the optimizer: :meth:`Applied.build_optimizer` (``OptimizerConfig.build``), or
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
    >>> from lightning_lowmem.functional.config import LoRAConfig
    >>> applied = apply(model, LoRAConfig(r=2, target=["0"]))  # one technique's config
    >>> applied.config.describe(), type(model[0]).__name__
    ('configured precision + lora(r=2) + configured optimizer', 'LoraLinear')
    >>> applied.undo()
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Mapping

import torch
from torch import nn

from lightning_lowmem.functional.config import TrainingConfig
from lightning_lowmem.functional.registry import techniques

__all__ = ["Applied", "apply", "step_context"]


@dataclass
class Applied:
    """What :func:`apply` did to a module, what a step needs, and how to undo it.

    Attributes:
        module: the transformed module.
        config: the applied config (a single technique's config is composed into a ``TrainingConfig``).
        reports: what each handler reports, by technique field (``applied.reports["lora"]``); a handler stores
            its report here (``applied.reports[field] = ...``), so a new technique needs no attribute. The
            built-ins' reports are also read (and written) as attributes: ``checkpointed`` (names of the
            submodules wrapped with activation checkpointing, ``[]``), ``lora`` (the
            :class:`~lightning_lowmem.functional.lora.LoraReport`), ``quantization``, ``cross_entropy`` (the
            :class:`~lightning_lowmem.functional.cross_entropy.ChunkedLoss`: heads deferred, losses routed),
            ``pruning`` (the :class:`~lightning_lowmem.functional.pruning.PruningReport` of a one-shot prune),
            ``qat`` (the names of the fake-quantized layers), ``compression_stats`` (the activation-compression
            figures of the steps run in :meth:`step_context`); ``None`` for a technique not applied.
        strict: a handler that matches nothing raises (``False``: it warns), as :func:`apply` was told.
        hold_kv_cache: activation compression holds a Hugging Face model's KV cache off, as :func:`apply` was told.
    """

    module: nn.Module = field(repr=False)
    config: TrainingConfig
    reports: dict[str, Any] = field(default_factory=dict)
    strict: bool = field(default=True, repr=False)
    hold_kv_cache: bool = field(default=True, repr=False)
    _undo: list[Callable[[], Any]] = field(default_factory=list, repr=False)

    def on_undo(self, undo: Callable[[], Any]) -> None:
        """Record how to give back what a handler is about to change; :meth:`undo` calls these last-in,
        first-out."""
        if not callable(undo):
            raise TypeError(f"`undo` must be callable (no arguments), got {type(undo).__name__}: {undo!r}")
        self._undo.append(undo)

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
        return self.config.microbatch.split(batch)

    def build_optimizer(self, params: Iterable[Any] | None = None, **overrides: Any) -> torch.optim.Optimizer:
        """The config's optimizer over ``params`` (default: the module's trainable parameters); ``overrides``
        win over the config's hyperparameters (e.g. ``foreach`` for a device)."""
        optimizer = self.config.optimizer
        if optimizer is None:
            raise ValueError("`config.optimizer` is None (the configured optimizer): there is no optimizer to build")
        if params is None:
            params = [p for p in self.module.parameters() if p.requires_grad]
        return optimizer.build(params, **overrides)

    def undo(self) -> None:
        """Give the module back as it was: every handler's recorded undo, last first (checkpointing
        unwrapped, adapters / quantized weights replaced by the original submodules and parameters,
        ``requires_grad`` and the KV cache restored). Idempotent."""
        while self._undo:
            self._undo.pop()()


def _report(technique_field: str, default: Callable[[], Any] | None = None) -> property:
    """``Applied.<name>``: a view of ``reports[technique_field]``."""

    def get(self: Applied) -> Any:
        if default is not None and self.reports.get(technique_field) is None:
            self.reports[technique_field] = default()
        return self.reports.get(technique_field)

    def set_(self: Applied, value: Any) -> None:
        self.reports[technique_field] = value

    return property(get, set_, doc=f"``reports[{technique_field!r}]``")


Applied.checkpointed = _report("checkpointing", list)  # type: ignore[attr-defined]
Applied.lora = _report("lora")  # type: ignore[attr-defined]
Applied.quantization = _report("quantization")  # type: ignore[attr-defined]
Applied.cross_entropy = _report("cross_entropy")  # type: ignore[attr-defined]
Applied.pruning = _report("pruning")  # type: ignore[attr-defined]
Applied.qat = _report("qat")  # type: ignore[attr-defined]
Applied.compression_stats = _report("compression")  # type: ignore[attr-defined]


def apply(
    module: nn.Module,
    config: Any,
    *,
    strict: bool = True,
    hold_kv_cache: bool = True,
) -> Applied:
    """Apply ``config``'s model-side techniques to ``module``, in place; return the handle that undoes them.

    Each technique's registered handler runs in its registered order (the built-ins' order and why:
    :mod:`lightning_lowmem.functional.handlers`).

    Args:
        module: any ``nn.Module`` (real, meta or fake parameters).
        config: a :class:`TrainingConfig`, a dict of its shorthands (``{"lora": {"r": 8}}``), one
            technique's config (``LoRAConfig(r=8)``), or a list / tuple of technique configs (the ones
            not given are off; precision and optimizer "as configured elsewhere").
        strict: a checkpointing policy that matches nothing raises (``False``: it warns). Default: ``True``.
        hold_kv_cache: switch a Hugging Face model's ``config.use_cache`` off while compression runs (what a
            training-time KV cache keeps, compression cannot pack). Default: ``True``.

    Returns:
        An :class:`Applied`; ``applied.undo()`` restores the module (state dict keys and values, module
        types, ``requires_grad``, ``use_cache``).

    Raises:
        ValueError / TypeError: the config is invalid or has no registered handler, or a technique cannot
            apply (a LoRA target or a checkpointing policy that matches nothing, ``"int8_static"``
            quantization, which needs calibration data: use ``quantize_static``), a chunked cross-entropy
            with no output head to find.
    """
    config = _training_config(config)
    applied = Applied(module, config, strict=strict, hold_kv_cache=hold_kv_cache)
    try:
        for technique in sorted(techniques(), key=lambda t: t.order):  # stable: registration order breaks ties
            technique_config = getattr(config, technique.field)
            if technique_config is not None:
                technique.handler(module, technique_config, applied)
    except BaseException:
        applied.undo()  # a technique that failed leaves the module as it came
        raise
    return applied


def _training_config(config: Any) -> TrainingConfig:
    """``config`` as a :class:`TrainingConfig`: kept, built from its shorthands, or composed of technique configs."""
    if isinstance(config, TrainingConfig):
        return config
    if isinstance(config, Mapping):
        return TrainingConfig(**config)
    configs = list(config) if isinstance(config, (list, tuple)) else [config]
    try:
        return TrainingConfig.of(*configs)
    except TypeError:
        raise TypeError(
            f"`config` must be a TrainingConfig or a dict of its arguments, a technique config (e.g. LoRAConfig(r=8)) "
            f"or a list of them, got {type(config).__name__}: {config!r}"
        ) from None


def step_context(config: TrainingConfig, stats: Any = None) -> ContextManager[Any]:
    """The context ``config``'s training step runs in: every registered technique's ``step_context`` (activation
    compression, adding to ``stats``), or nothing."""
    contexts = [
        functools.partial(t.step_context, getattr(config, t.field))
        for t in techniques()
        if t.step_context is not None and getattr(config, t.field) is not None
    ]
    if not contexts:
        return contextlib.nullcontext()
    if len(contexts) == 1:
        return contexts[0](stats)
    return _entered_together(contexts, stats)


@contextlib.contextmanager
def _entered_together(contexts: list[Callable[[Any], ContextManager[Any]]], stats: Any) -> Any:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(context(stats)) for context in contexts]
