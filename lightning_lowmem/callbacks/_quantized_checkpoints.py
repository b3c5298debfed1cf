"""Quantized checkpoints through Lightning: what ``PostTrainingQuantization`` records, how a model is
quantized back before its weights load, and a ``CheckpointIO`` swap so ``ckpt_path=`` can read them.

Lightning's ``TorchCheckpointIO`` loads with ``map_location=lambda storage, loc: storage`` (everything
on CPU); torch cannot rebuild tensor subclasses, such as torchao's quantized weights, through a callable
``map_location``. The quantization callbacks swap in a ``TorchCheckpointIO`` that passes ``"cpu"``
instead (the same placement) for the duration of a stage and put the original back at teardown.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch import nn
from typing_extensions import override

from lightning_lowmem.functional.quantization import _quantize_layers, drop_zero_point, quantizable_layers

__all__ = ["CHECKPOINT_KEY", "load_quantized_checkpoint", "quantize_like_checkpoint"]

CHECKPOINT_KEY = "lowmem_quantization"


class CpuMapCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose default ``map_location`` is ``"cpu"`` rather than a callable."""

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        return super().load_checkpoint(path, map_location=map_location or "cpu", weights_only=weights_only)


def swap_in(trainer: L.Trainer) -> TorchCheckpointIO | None:
    """Replace the strategy's plain ``TorchCheckpointIO`` (only that: a user's own plugin is kept).
    Returns the replaced plugin, for :func:`swap_back`, or ``None``."""
    original = trainer.strategy.checkpoint_io
    if type(original) is not TorchCheckpointIO:
        return None
    trainer.strategy.checkpoint_io = CpuMapCheckpointIO()
    return original


def swap_back(trainer: L.Trainer, original: TorchCheckpointIO | None) -> None:
    if original is not None and isinstance(trainer.strategy.checkpoint_io, CpuMapCheckpointIO):
        trainer.strategy.checkpoint_io = original


def _checkpoint_spec(checkpoint: dict[str, Any], source: str) -> dict[str, Any] | None:
    spec = checkpoint.get(CHECKPOINT_KEY)
    if spec and spec["mode"] == "int8_static":
        raise ValueError(
            f"{source} was saved after PostTrainingQuantization(mode='int8_static'): an exported int8 graph cannot "
            "be rebuilt from a checkpoint. Load the float checkpoint and quantize again."
        )
    return spec


def quantize_like_checkpoint(module: nn.Module, checkpoint: dict[str, Any]) -> list[str]:
    """Quantize ``module``'s layers the way a checkpoint saved after :class:`PostTrainingQuantization`
    records, so that its ``state_dict`` loads; a float checkpoint changes nothing.

    Lightning calls ``LightningModule.on_load_checkpoint`` before it loads the weights, so calling this
    from that hook makes ``Model.load_from_checkpoint(path, map_location="cpu")`` return the quantized
    model (``map_location`` must not be a callable, Lightning's default: torch cannot rebuild torchao
    tensors through one). Layers already quantized are left as they are.

    Args:
        module: the model the checkpoint's ``state_dict`` belongs to.
        checkpoint: the loaded checkpoint dict.

    Returns:
        Names of the layers quantized now.

    Raises:
        ValueError: the checkpoint was saved after ``mode="int8_static"``.

    Example::

        class QuantizedClassifier(DigitsClassifier):
            def on_load_checkpoint(self, checkpoint):
                quantize_like_checkpoint(self, checkpoint)

        model = QuantizedClassifier.load_from_checkpoint("quantized.ckpt", map_location="cpu")
    """
    spec = _checkpoint_spec(checkpoint, "the checkpoint")
    if not spec:
        return []
    candidates = set(quantizable_layers(module, spec["mode"], group_size=spec["group_size"], embeddings=True))
    names = [name for name in spec["quantized"] if name in candidates]
    if names:
        _quantize_layers(module, spec["mode"], names, group_size=spec["group_size"])
    match_zero_points(module, checkpoint.get("state_dict", {}))
    return names


def match_zero_points(module: nn.Module, state_dict: dict[str, Any], prefix: str = "") -> None:
    """Drop torchao's all-zero zero points from the incoming weights wherever ``module``'s quantized
    weight has none (:func:`~lightning_lowmem.functional.quantization.drop_zero_points_`), so a
    checkpoint written by torchao directly, or before that, loads."""
    for fqn, layer in module.named_modules():
        weight = getattr(layer, "weight", None)
        if weight is not None and getattr(weight, "zero_point", 0) is None:
            drop_zero_point(state_dict.get(f"{prefix}{fqn}.weight"))


def load_quantized_checkpoint(
    model_class: type[L.LightningModule], checkpoint_path: str, *, map_location: Any = "cpu", weights_only: bool | None = None, **kwargs: Any
) -> L.LightningModule:
    """Rebuild a LightningModule from a checkpoint saved after :class:`PostTrainingQuantization`.

    Builds ``model_class(**hyper_parameters, **kwargs)``, quantizes the layers the checkpoint records
    (Linear and Embedding) with the recorded mode, then loads the weights (a float checkpoint loads as float).

    Args:
        model_class: the LightningModule class (it must save its hyper-parameters).
        checkpoint_path: the ``.ckpt`` file.
        map_location: passed to ``torch.load``. Default: ``"cpu"``.
        weights_only: passed to ``torch.load``; torchao registers its tensor classes as safe globals,
            so ``True`` works for the quantized weights. Default: ``None`` (torch's default).
        **kwargs: override hyper-parameters.
    """
    checkpoint = torch.load(checkpoint_path, map_location=map_location, weights_only=weights_only)
    _checkpoint_spec(checkpoint, repr(checkpoint_path))
    model = model_class(**{**checkpoint.get("hyper_parameters", {}), **kwargs})
    quantize_like_checkpoint(model, checkpoint)
    model.load_state_dict(checkpoint["state_dict"])
    return model
