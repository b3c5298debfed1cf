"""What ``PostTrainingQuantization`` and ``QuantizationAwareTraining`` share: the one state-dict matcher run
before a checkpoint's weights load, and the checkpoint plumbing around it (record on save, hooks released at teardown).

The matcher (:meth:`QuantizationCallback.match_state_dict`) makes every layer's weight kind match the
incoming state dict: a quantized incoming weight is taken as it is, Conv1D layers recorded as converted
become ``nn.Linear`` (:func:`lightning_lowmem.checkpoints.quantized.prepare_for_load`); with ``requantize_float_loads``, a
quantized layer receiving a float weight gets a float parameter and is quantized again after loading
(:mod:`lightning_lowmem.functional.quantization.matching`).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch import nn
from typing_extensions import override

from lightning_lowmem.callbacks._technique_base import TechniqueCallback
from lightning_lowmem.checkpoints import quantized as _quantized_checkpoints
from lightning_lowmem.functional.quantization.matching import float_weights_for_load_, requantize_

__all__ = ["QuantizationCallback"]


class QuantizationCallback(TechniqueCallback):
    """Base of the quantization callbacks (not for direct use): subclasses set ``mode``, call
    :meth:`attach_load_hooks` in ``setup`` and override :meth:`on_quantized_weights_loaded`."""

    #: quantized layers receiving float weights are given float parameters, then quantized again after loading
    requantize_float_loads = False

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.conv1d: list[str] = []
        self._load_handles: list[Any] = []
        self._requantize: list[str] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.mode)

    @property
    def writer(self) -> str:
        """What a checkpoint records as its writer, e.g. ``PostTrainingQuantization(mode='int8_dynamic')``."""
        return f"{type(self).__name__}(mode={self.mode!r})"

    def attach_load_hooks(self, trainer: L.Trainer, pl_module: nn.Module) -> None:
        """Run :meth:`match_state_dict` before (and the re-quantization after) ``pl_module`` loads a state dict."""
        if not self._load_handles:
            self._load_handles = [
                pl_module.register_load_state_dict_pre_hook(self.match_state_dict),
                pl_module.register_load_state_dict_post_hook(self._requantize_after_load),
            ]

    def match_state_dict(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """The state-dict matcher (a ``load_state_dict`` pre-hook): each layer's weight kind (float /
        quantized, Conv1D / Linear) is made to match the incoming one, so ``load_state_dict`` copies in place."""
        names, conv1d = _quantized_checkpoints.prepare_for_load(module, state_dict, prefix)
        self.on_quantized_weights_loaded(module, names)
        self.conv1d = sorted(set(self.conv1d) | set(conv1d))
        if self.requantize_float_loads:  # a float checkpoint of a converted model: load float, quantize after
            self._requantize.extend(float_weights_for_load_(module, state_dict, prefix))

    def on_quantized_weights_loaded(self, module: nn.Module, names: list[str]) -> None:
        """Override point: the layers ``names`` just took a checkpoint's quantized weights."""

    def requantize_config(self) -> Any:
        """Override point: the torchao config layers loaded from float weights are quantized with again."""
        raise NotImplementedError

    def _requantize_after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        if self._requantize:
            requantize_(module, self._requantize, self.requantize_config())
            self._requantize = []

    def record_checkpoint(self, checkpoint: dict[str, Any], record: dict[str, Any], *, instruct: bool = False) -> None:
        """Record in ``checkpoint`` what wrote it and make its torchao tensors portable."""
        _quantized_checkpoints.record_checkpoint(checkpoint, self.writer, record, instruct=instruct)

    @override
    def composition_label(self) -> str:
        return f"{type(self).__name__}({self.mode!r})"

    @override
    def release(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self._load_handles:
            handle.remove()
        self._load_handles = []
