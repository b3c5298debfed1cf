"""`LowRankAdapters`: fine-tune with LoRA / QLoRA adapters; checkpoints hold the adapters only."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lowmem.callbacks._technique_base import TechniqueCallback
from lightning_lowmem.checkpoints import guard_module_loading, record, unguard_module_loading
from lightning_lowmem.functional.config import LoRAConfig
from lightning_lowmem.functional.lora.adapters import (
    ALL_LINEAR,
    LoraReport,
    lora_layers,
    merged_state_dict,
    trained_modules,
)
from lightning_lowmem.functional.lora.bookkeeping import (
    adapter_entries,
    check_same_settings,
    check_weights_path,
    checkpoint_record,
    load_base_weights_,
    parameter_metrics,
    settings_conflict,
    wrap_summary,
)
from lightning_lowmem.functional.lora.files import export_root, lora_config
from lightning_lowmem.functional.optimizers.convert import drop_frozen_

PREFIX = "lowmem/lora"
WRITER = "LowRankAdapters"
FORMAT_VERSION = 1


class LowRankAdapters(TechniqueCallback):
    """Wrap chosen linear / convolution layers with LoRA adapters at ``setup`` and train only the adapters.

    At ``setup`` (before ``configure_optimizers`` runs) every matching ``nn.Linear`` / Hugging Face
    ``Conv1D`` of the LightningModule gets a trainable low-rank update and every other parameter is
    frozen (see :func:`lightning_lowmem.functional.lora.apply_lora_`). At fit start frozen parameters
    are taken out of the optimizers' param groups, so only adapters appear there. Checkpoints keep only
    the adapter tensors (the base model is rebuilt from its own pretrained weights), the callback's
    state records the adapter settings, and resuming restores adapters and optimizer state exactly.
    :func:`lightning_lowmem.functional.lora.load_adapters` puts a checkpoint's adapters into a fresh
    base model.

    Args:
        r: adapter rank, > 0. Default: 8.
        alpha: the update is scaled by ``alpha / r``. Default: 16.0.
        dropout: dropout on the adapters' input, in [0, 1). Default: 0.0.
        target: ``"all-linear"`` (every linear layer but output heads such as ``lm_head``, attention
            projections included), ``"all-conv"`` (every ``nn.Conv2d``), ``"all"`` (both) or layer
            name patterns / class names (``["c_attn", "c_proj"]``, ``"h.*.mlp.*"``, ``"Conv1D"``);
            each pattern must match a layer. Default: ``"all-linear"``.
        quantize_base: ``None``, ``"nf4"``, ``"int8"`` or ``"int4"``: hold the wrapped layers' frozen weights
            quantized (QLoRA, via torchao): ``"nf4"`` (QLoRA's 4-bit NormalFloat; CPU and CUDA) is the 4-bit
            choice, ``"int4"`` needs CUDA. The base is quantized in the dtype the Trainer's precision trains in
            (``bf16-true``: from bf16 weights). Default: ``None``.
        quantize_frozen: with ``quantize_base``, also quantize the other frozen weights (``lm_head``,
            embedding tables; tied weights stay float). Default: ``False``.
        save_base_weights: also keep the frozen base weights in checkpoints. Default: ``False``.
        base_weights_path: a file with the pretrained base weights (a Lightning checkpoint or a plain
            state dict of the LightningModule), loaded with ``strict=True`` at ``setup`` before the
            adapters are added; for YAML configs, where the model is built from init args. Default: ``None``.
        merged_weights_path: when set, at the end of ``fit`` write the merged float weights to this file,
            loadable with ``strict=True`` into the original architecture: a Hugging Face model the LightningModule
            wraps (``LlamaForCausalLM(config)``, keys without the wrapper's ``model.``), else the un-wrapped
            LightningModule. Default: ``None``.
        train_modules: modules trained in full beside the adapters (a freshly initialised classification
            head): ``"auto"`` = modules named ``classifier`` / ``score``; a name pattern or a list of them;
            ``None`` = none. Kept in adapter-only checkpoints. Default: ``"auto"``.

    Raises:
        ValueError: bad ``r``, ``alpha``, ``dropout``, ``quantize_base``, ``target``; at ``setup``, a
            pattern that matches no layer (the message lists layer names).

    Example::

        >>> from lightning_lowmem.demo import CharLM
        >>> model = CharLM(n_layer=1, n_embd=32, n_head=2, block_size=16)
        >>> callback = LowRankAdapters(r=4, target=["c_attn", "c_proj"])
        >>> trainer = L.Trainer(max_steps=1, callbacks=[callback], logger=False, enable_progress_bar=False,
        ...                     enable_checkpointing=False, enable_model_summary=False)
        >>> callback.setup(trainer, model, "fit")
        >>> callback.report.trainable_params, sum(p.requires_grad for p in model.parameters())
        (1408, 6)
    """

    technique = "lora"
    tags = frozenset({"lora"})
    undo_on_teardown = False  # the adapters are the fit's result (undone only when the fit fails before training)

    def __init__(
        self,
        r: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.0,
        target: str | list[str] = ALL_LINEAR,
        quantize_base: str | None = None,
        quantize_frozen: bool = False,
        save_base_weights: bool = False,
        base_weights_path: str | None = None,
        merged_weights_path: str | None = None,
        train_modules: str | list[str] | None = "auto",
    ) -> None:
        self.config = LoRAConfig(
            r, alpha, dropout, target, quantize_base, quantize_frozen, train_modules=train_modules
        )  # validates
        self.train_modules = list(train_modules) if isinstance(train_modules, (list, tuple)) else train_modules
        target = list(target) if isinstance(target, (list, tuple)) else target
        check_weights_path("base_weights_path", base_weights_path)
        check_weights_path("merged_weights_path", merged_weights_path)
        self.r = r
        self.alpha = float(alpha)
        self.dropout = float(dropout)
        self.target = target
        self.quantize_base = quantize_base
        self.quantize_frozen = quantize_frozen
        self.save_base_weights = bool(save_base_weights)
        self.base_weights_path = base_weights_path
        self.merged_weights_path = merged_weights_path
        self.report: LoraReport | None = None
        self.removed_from_optimizers = 0

    @override
    def composition_label(self) -> str:
        return f"LowRankAdapters(r={self.r})"

    @override
    def setup_technique(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        guard_module_loading(trainer, pl_module)  # check what wrote a checkpoint before Lightning loads it
        if lora_layers(pl_module):  # a second fit / validate on the same wrapped module
            config = lora_config(pl_module)
            if config["r"] != self.r:
                raise ValueError(f"the module already has adapters of rank {config['r']}, this callback has r={self.r}")
        else:
            if self.base_weights_path is not None:
                load_base_weights_(pl_module, self.base_weights_path)
            if self.quantize_base is not None:
                # quantize in the dtype it trains in: the precision plugin's conversion (bf16-true: bf16) first,
                # which Lightning repeats after `setup` (a quantized base keeps its format through it)
                self._convert_for_quantization(trainer, pl_module)
            device = trainer.strategy.root_device
            if self.quantize_base == "int4" and device.type == "cuda":
                # torchao's int4 (tinygemm) packs weights for the device they are on: quantize where they will
                # train (Lightning moves the module after `setup`; moving it first changes nothing else)
                pl_module.to(device)
            # kept after fit (adapters are the trained result); undone if the fit fails before training
            # a technique that must come first (a layer freeze) applies first (again, if it ran already: the same
            # result), so e.g. frozen blocks get no adapter whatever the callbacks' order
            first = [c.config for c in trainer.callbacks if c is not self and getattr(c, "applies_first", False)]
            self.report = self.apply_config(pl_module, [*first, self.config]).lora
            self.on_rollback(self._forget_report)
            rank_zero_info(wrap_summary(self.report))
        if not self.save_base_weights:
            strict_loading = pl_module.strict_loading
            self.on_rollback(lambda: setattr(pl_module, "strict_loading", strict_loading))
            pl_module.strict_loading = False  # adapter-only checkpoints lack the (pretrained) base keys

    def _forget_report(self) -> None:
        self.report = None

    def _convert_for_quantization(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The precision plugin's conversion, now; a failed setup gives each converted tensor its old data back."""
        tensors = [*pl_module.parameters(), *pl_module.buffers()]
        before = [(tensor, tensor.data) for tensor in tensors]
        trainer.precision_plugin.convert_module(pl_module)
        changed = [(tensor, data) for tensor, data in before if tensor.data is not data]

        def restore() -> None:
            for tensor, data in changed:
                tensor.data = data

        self.on_rollback(restore)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Runs after configure_optimizers and before optimizer state is restored on resume, so
        # dropping frozen parameters here keeps saved and restored param groups aligned.
        self.removed_from_optimizers += drop_frozen_(trainer.optimizers)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # the setup is committed
        self._applied = None  # so the undo handle (QLoRA: the float weights) is not kept
        metrics = parameter_metrics(pl_module, PREFIX)
        for logger in trainer.loggers:  # once per fit: a logger call, not pl_module.log's per-step repeat
            logger.log_metrics(metrics, step=trainer.global_step)

    def _settings(self) -> dict[str, Any]:
        return {"r": self.r, "alpha": self.alpha, "quantize_base": self.quantize_base}

    def checkpoint_reader(self) -> tuple[str, Any]:
        """(writer, accept) for :func:`lightning_lowmem.checkpoints.check`: the same adapter settings only."""

        def accept(entry: dict[str, Any]) -> str | None:
            return settings_conflict(entry, self._settings(), FORMAT_VERSION)

        return WRITER, accept

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        target = self.report.wrapped if self.report else self.target
        entry = checkpoint_record(
            self._settings(), target, save_base_weights=self.save_base_weights, version=FORMAT_VERSION
        )
        record(checkpoint, writer=WRITER, **entry)
        if not self.save_base_weights:
            checkpoint["state_dict"] = adapter_entries(checkpoint["state_dict"], trained_modules(pl_module))

    @override
    def release(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        unguard_module_loading(pl_module)
        self._applied = None  # after the rollback's undo (last first), or the committed setup's handle

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.merged_weights_path is None:
            return
        name, model = export_root(pl_module)  # a wrapped Hugging Face model: its own keys (issue #34)
        state = merged_state_dict(model)
        if trainer.is_global_zero:
            os.makedirs(os.path.dirname(os.path.abspath(self.merged_weights_path)), exist_ok=True)
            torch.save(state, self.merged_weights_path)
            keys = f"the keys of `{name}`, a {type(model).__name__}" if name else "the LightningModule's keys"
            rank_zero_info(f"LowRankAdapters: merged weights written to {self.merged_weights_path} ({keys})")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "lora_config": {
                "r": self.r,
                "alpha": self.alpha,
                "dropout": self.dropout,
                "quantize_base": self.quantize_base,
                "target": self.report.wrapped if self.report else self.target,
                "train_modules": self.report.trained if self.report else [],
            }
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_same_settings(state_dict.get("lora_config", {}), self._settings())


__all__ = ["LowRankAdapters"]
