"""`QuantizationAwareTraining`: torchao QAT (``QATConfig`` prepare -> train -> convert) around ``fit``."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_lowmem.callbacks._quantization_base import QuantizationCallback
from lightning_lowmem.functional.config.constants import GROUP_SIZE
from lightning_lowmem.functional.config.qat import QATConfig
from lightning_lowmem.functional.handlers import restore_point
from lightning_lowmem.functional.quantization.layers import is_conv1d
from lightning_lowmem.functional.quantization.ptq import dequantize_
from lightning_lowmem.functional.quantization.qat import (
    convert_qat_,
    prepare_qat_,
    qat_base_config,
    qat_coverage_warning,
    qat_layers,
    set_fake_quant_enabled,
)
from lightning_lowmem.functional.quantization.report import QuantizationReport, warn_if_mostly_float
from lightning_lowmem.warnings import LowMemWarning

__all__ = ["QuantizationAwareTraining"]


class QuantizationAwareTraining(QuantizationCallback):
    """Train with fake-quantized ``nn.Linear`` weights, then convert to real quantized weights.

    The layers are swapped for torchao ``FakeQuantizedLinear`` in ``setup`` (the same weight
    ``nn.Parameter`` objects are kept, so optimizers and pruning masks made later see them);
    fake quantization is on from global step ``start_step`` on, also in a run resumed from a checkpoint
    (decided when training starts, after Lightning restored the step). At the end of ``fit`` the layers are
    converted (``QATConfig(step="convert")``).

    Hugging Face models: GPT-2's ``Conv1D`` layers become exact ``nn.Linear`` layers first and are trained
    fake-quantized like the others; a head tied to the token table (GPT-2, BERT, T5) is fake-quantized in
    training and, at convert, the one tied tensor is quantized once and shared by the table again (stored
    once). Other embedding tables stay float.

    Lightning regressions this covers (each has a test): pruning in the same Trainer, ``fit`` called
    twice (a converted model is dequantized and prepared again, then training continues from its
    quantized weights), ``trainer.test(ckpt_path=...)`` after training (a float/fake-quantized
    checkpoint loaded into a converted model is converted again after loading; a converted checkpoint
    loaded into a float model takes its quantized weights first), and resuming with ``ckpt_path=``
    (bit-identical to an uninterrupted run).

    Args:
        mode: ``"int8_weight_only"``, ``"intx4_weight_only"`` (int4 values, any device) or
            ``"int4_weight_only"`` (CUDA). Default: ``"intx4_weight_only"``.
        start_step: global step from which weights are fake-quantized. Default: ``0``.
        freeze_bn_step: from this global step, BatchNorm layers stay in eval mode (running statistics
            frozen, the usual QAT "freeze observers" step; torchao weight fake quantizers have no
            observer state: scales follow the weights). Default: ``None`` (never).
        convert_on_fit_end: convert to real quantized weights at the end of ``fit``. Default: ``True``.
        skip_modules: submodules kept in float (qualified names, dotted suffixes, globs or class names); an
            entry naming nothing raises at ``setup``, listing the model's layers. Default: ``()``.
        filter_fn: ``filter_fn(layer, fqn) -> bool``. Default: ``None``.
        group_size: group length of the int4 modes. Default: ``GROUP_SIZE`` (32).

    The arguments are validated once, by the :class:`~lightning_lowmem.functional.config.QATConfig` this builds
    (kept as :attr:`config`).

    Override points: :meth:`prepare` (``setup``: swap in the fake-quantized layers, returns their names),
    :meth:`convert` (fit end: real quantized weights, returns a ``QuantizationReport``),
    :meth:`requantize_config` (the torchao config a float checkpoint loaded into a converted model is
    quantized with again). The transforms live in :mod:`lightning_lowmem.functional.quantization.qat`;
    checkpoint loading goes through the state-dict matcher shared with ``PostTrainingQuantization``.

    Raises:
        ValueError: unknown ``mode``, negative ``start_step`` / ``freeze_bn_step``.

    Example::

        >>> callback = QuantizationAwareTraining("intx4_weight_only", start_step=10)
    """

    requantize_float_loads = True
    technique = "qat"

    @override
    def composition_tags(self) -> frozenset[str]:
        # the 4-bit modes quantize in groups of `group_size` input channels
        return frozenset({"qat"} | ({"grouped_qat"} if "4" in self.mode else set()))

    def __init__(
        self,
        mode: str = "intx4_weight_only",
        *,
        start_step: int = 0,
        freeze_bn_step: int | None = None,
        convert_on_fit_end: bool = True,
        skip_modules: Sequence[str] = (),
        filter_fn: Callable[[nn.Module, str], bool] | None = None,
        group_size: int = GROUP_SIZE,
    ) -> None:
        self.config = QATConfig(  # every check is the config's (#27)
            mode,
            start_step=start_step,
            freeze_bn_step=freeze_bn_step,
            convert_on_fit_end=convert_on_fit_end,
            skip_modules=skip_modules,
            filter_fn=filter_fn,
            group_size=group_size,
        )
        super().__init__(mode)
        self.start_step = start_step
        self.freeze_bn_step = freeze_bn_step
        self.convert_on_fit_end = convert_on_fit_end
        self.skip_modules = list(skip_modules)
        self.filter_fn = filter_fn
        self.group_size = group_size
        self.prepared: list[str] = []
        self.converted: list[str] = []
        self.report: QuantizationReport | None = None
        self._fake_quant_on: bool | None = None

    # --- override points: *what* is done ---------------------------------------------------------------

    def prepare(self, pl_module: nn.Module) -> list[str]:
        """Swap the chosen layers for fake-quantized ones (same weight Parameters); returns their names."""
        chosen = qat_layers(
            pl_module, self.mode, filter_fn=self.filter_fn, skip_modules=self.skip_modules, group_size=self.group_size
        )
        conv1d = [name for name in chosen if is_conv1d(pl_module.get_submodule(name))]
        reason = qat_coverage_warning(pl_module, chosen, self.mode)
        if reason is not None:  # at setup, before training: not only in the report after it
            rank_zero_warn(f"QuantizationAwareTraining: {reason}", category=LowMemWarning)
        prepared = prepare_qat_(
            pl_module, self.mode, filter_fn=self.filter_fn, skip_modules=self.skip_modules, group_size=self.group_size
        )
        self.conv1d = sorted(set(self.conv1d) | set(conv1d))
        if prepared:
            rank_zero_info(
                f"QuantizationAwareTraining ({self.mode}): {len(prepared)} layers fake-quantized"
                + (f", {len(conv1d)} Conv1D -> nn.Linear" if conv1d else "")
                + f", from global step {self.start_step}"
            )
        return prepared

    def convert(self, pl_module: nn.Module) -> QuantizationReport:
        """Turn the fake-quantized layers into real quantized weights."""
        report = convert_qat_(pl_module, self.mode, group_size=self.group_size)
        report.conv1d = [name for name in self.conv1d if name in report.converted]
        return report

    @override
    def requantize_config(self) -> Any:
        return qat_base_config(self.mode, self.group_size)

    @override
    def on_quantized_weights_loaded(self, module: nn.Module, names: list[str]) -> None:
        self.converted = sorted(set(self.converted) | set(names))

    # --- when ----------------------------------------------------------------------------------------------

    @override
    def setup_technique(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.attach_load_hooks(trainer, pl_module)  # so that `ckpt_path=` may hold converted weights
        if stage != "fit":
            return
        self.on_rollback(self._rollback_point(pl_module))
        if self.converted:  # fit called again: continue training from the quantized weights
            dequantize_(pl_module)
            self.converted = []
        self.prepared = sorted(set(self.prepared) | set(self.prepare(pl_module)))
        # the step is known only once Lightning restored a checkpoint: decided again in on_train_start
        self._set_fake_quant(pl_module, trainer.global_step >= self.start_step)

    def _rollback_point(self, pl_module: nn.Module) -> Callable[[], None]:
        """How to give back the layers and this callback's record as they are before ``prepare``."""
        structure = restore_point(pl_module)
        prepared, converted, conv1d = list(self.prepared), list(self.converted), list(self.conv1d)

        def rollback() -> None:
            structure()
            self.prepared, self.converted, self.conv1d, self._fake_quant_on = prepared, converted, conv1d, None

        return rollback

    def _set_fake_quant(self, pl_module: nn.Module, enabled: bool) -> None:
        if self._fake_quant_on is not enabled:
            set_fake_quant_enabled(pl_module, enabled)
            self._fake_quant_on = enabled

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # the setup is committed
        self._set_fake_quant(pl_module, trainer.global_step >= self.start_step)  # the restored step, on resume

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step >= self.start_step:
            self._set_fake_quant(pl_module, True)
        if self.freeze_bn_step is not None and trainer.global_step >= self.freeze_bn_step:
            for layer in pl_module.modules():
                if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                    layer.eval()

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.convert_on_fit_end:
            return
        self.report = self.convert(pl_module)
        self.converted = list(self.report.converted)
        self._fake_quant_on = None
        rank_zero_info(f"QuantizationAwareTraining: {self.report.summary()}")
        warn_if_mostly_float(pl_module, self.report)

    # --- resumable state -----------------------------------------------------------------------------------

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.prepared or self.converted:
            self.record_checkpoint(checkpoint, {"group_size": self.group_size, **self.state_dict()})

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "prepared": list(self.prepared),
            "converted": list(self.converted),
            "conv1d": list(self.conv1d),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.prepared = list(state_dict.get("prepared", []))
        self.conv1d = list(state_dict.get("conv1d", []))
