"""`QuantizationAwareTraining`: torchao QAT (``QATConfig`` prepare -> train -> convert) around ``fit``."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_lowmem.callbacks import _quantized_checkpoints
from lightning_lowmem.functional.quantization import (
    QAT_MODES,
    QuantizationReport,
    _apply_config,
    _qat_base_config,
    convert_qat_,
    dequantize_,
    prepare_qat_,
    set_fake_quant_enabled,
)
from lightning_lowmem.memory.units import format_bytes

__all__ = ["QuantizationAwareTraining"]


def _is_quantized(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and type(tensor) not in (torch.Tensor, nn.Parameter)


class QuantizationAwareTraining(L.Callback):
    """Train with fake-quantized ``nn.Linear`` weights, then convert to real quantized weights.

    The layers are swapped for torchao ``FakeQuantizedLinear`` in ``setup`` (the same weight
    ``nn.Parameter`` objects are kept, so optimizers and pruning masks made later see them);
    fake quantization is switched on at ``start_step``. At the end of ``fit`` the layers are
    converted (``QATConfig(step="convert")``).

    Lightning regressions this covers (each has a test): pruning in the same Trainer, ``fit`` called
    twice (a converted model is dequantized and prepared again, then training continues from its
    quantized weights), and ``trainer.test(ckpt_path=...)`` after training (a float/fake-quantized
    checkpoint loaded into a converted model is converted again after loading; a converted checkpoint
    loaded into a float model quantizes the layers first).

    Args:
        mode: ``"int8_weight_only"``, ``"intx4_weight_only"`` (int4 values, any device) or
            ``"int4_weight_only"`` (CUDA). Default: ``"intx4_weight_only"``.
        start_step: global step from which weights are fake-quantized. Default: ``0``.
        freeze_bn_step: from this global step, BatchNorm layers stay in eval mode (running statistics
            frozen, the usual QAT "freeze observers" step; torchao weight fake quantizers have no
            observer state: scales follow the weights). Default: ``None`` (never).
        convert_on_fit_end: convert to real quantized weights at the end of ``fit``. Default: ``True``.
        skip_modules: names of submodules kept in float. Default: ``()``.
        filter_fn: ``filter_fn(layer, fqn) -> bool``. Default: ``None``.
        group_size: group length of the int4 modes. Default: ``32``.

    Raises:
        ValueError: unknown ``mode``, negative ``start_step`` / ``freeze_bn_step``.

    Example::

        >>> callback = QuantizationAwareTraining("intx4_weight_only", start_step=10)
    """

    def __init__(
        self,
        mode: str = "intx4_weight_only",
        *,
        start_step: int = 0,
        freeze_bn_step: int | None = None,
        convert_on_fit_end: bool = True,
        skip_modules: Sequence[str] = (),
        filter_fn: Callable[[nn.Module, str], bool] | None = None,
        group_size: int = 32,
    ) -> None:
        if mode not in QAT_MODES:
            raise ValueError(f"`mode`={mode!r} is not a QAT mode; choose one of {list(QAT_MODES)}.")
        if not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"`start_step` must be an int >= 0, got {start_step!r}.")
        if freeze_bn_step is not None and (not isinstance(freeze_bn_step, int) or freeze_bn_step < 0):
            raise ValueError(f"`freeze_bn_step` must be None or an int >= 0, got {freeze_bn_step!r}.")
        if isinstance(skip_modules, str):
            raise TypeError(f"`skip_modules` must be a list of module names, got the string {skip_modules!r}.")
        self.mode = mode
        self.start_step = start_step
        self.freeze_bn_step = freeze_bn_step
        self.convert_on_fit_end = convert_on_fit_end
        self.skip_modules = list(skip_modules)
        self.filter_fn = filter_fn
        self.group_size = group_size
        self.prepared: list[str] = []
        self.converted: list[str] = []
        self.report: QuantizationReport | None = None
        self._handles: list[Any] = []
        self._reconvert: list[str] = []
        self._replaced_io: Any = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.mode)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self._handles:
            self._handles = [
                pl_module.register_load_state_dict_pre_hook(self._match_before_load),
                pl_module.register_load_state_dict_post_hook(self._reconvert_after_load),
            ]
        if self._replaced_io is None:  # so that `ckpt_path=` may hold converted (quantized) weights
            self._replaced_io = _quantized_checkpoints.swap_in(trainer)
        if stage != "fit":
            return
        if self.converted:  # fit called again: continue training from the quantized weights
            dequantize_(pl_module)
            self.converted = []
        self.prepared = sorted(
            set(self.prepared)
            | set(prepare_qat_(pl_module, self.mode, filter_fn=self.filter_fn, skip_modules=self.skip_modules, group_size=self.group_size))
        )
        set_fake_quant_enabled(pl_module, trainer.global_step >= self.start_step)

    def _match_before_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Make each layer's weight kind (float / quantized) match the incoming one before loading."""
        to_quantize = []
        for fqn, layer in module.named_modules():
            if not isinstance(layer, nn.Linear):
                continue
            incoming = state_dict.get(f"{prefix}{fqn}.weight")
            if incoming is None:
                continue
            if _is_quantized(incoming) and not _is_quantized(layer.weight):
                to_quantize.append(fqn)
            elif not _is_quantized(incoming) and _is_quantized(layer.weight):
                self._reconvert.append(fqn)  # float checkpoint of a converted model: convert again after load
        if self._reconvert:
            for fqn in self._reconvert:
                layer = module.get_submodule(fqn)
                layer.weight = nn.Parameter(layer.weight.dequantize().to(torch.float32))
                layer.__dict__.pop("extra_repr", None)
        if to_quantize:
            from torchao.quantization.qat import FakeQuantizedLinear

            fake = [fqn for fqn in to_quantize if isinstance(module.get_submodule(fqn), FakeQuantizedLinear)]
            if fake:
                convert_qat_(module, self.mode, group_size=self.group_size)
            plain = [fqn for fqn in to_quantize if fqn not in fake]
            if plain:
                _apply_config(module, _qat_base_config(self.mode, self.group_size), plain)
            self.converted = sorted(set(self.converted) | set(to_quantize))

    def _reconvert_after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        if self._reconvert:
            _apply_config(module, _qat_base_config(self.mode, self.group_size), self._reconvert)
            self._reconvert = []

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.start_step:
            set_fake_quant_enabled(pl_module, True)
        if self.freeze_bn_step is not None and trainer.global_step >= self.freeze_bn_step:
            for layer in pl_module.modules():
                if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                    layer.eval()

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.convert_on_fit_end:
            return
        self.report = convert_qat_(pl_module, self.mode, group_size=self.group_size)
        self.converted = list(self.report.converted)
        rank_zero_info(
            f"QuantizationAwareTraining ({self.mode}): converted {len(self.converted)} layers, "
            f"{format_bytes(self.report.bytes_before)} -> {format_bytes(self.report.bytes_after)}"
        )

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        _quantized_checkpoints.swap_back(trainer, self._replaced_io)
        self._replaced_io = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "prepared": list(self.prepared), "converted": list(self.converted)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.prepared = list(state_dict.get("prepared", []))
