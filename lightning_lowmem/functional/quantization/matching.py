"""Matching a model's weight kinds to an incoming state dict: the float half of checkpoint loading.

A quantized model may be handed a *float* state dict (``trainer.test(ckpt_path="best")`` after QAT
converted the model at fit end, the best checkpoint being one of the fake-quantized training ones).
:func:`float_weights_for_load_` gives each quantized layer whose incoming weight is float a float
parameter to load into (layers that shared a quantized weight share the float one), and
:func:`requantize_` quantizes those layers again once the weights are in (tied groups quantized once
and shared again). The quantized half (incoming torchao tensors) is
``lightning_lowmem.checkpoints.quantized.prepare_for_load``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from lightning_lowmem.functional.quantization.conv import quantize_conv2d_
from lightning_lowmem.functional.quantization.layers import tied_groups
from lightning_lowmem.functional.quantization.modes import apply_config
from lightning_lowmem.functional.quantization.serialization import is_quantized_tensor

__all__ = ["float_weights_for_load_", "requantize_"]


def float_weights_for_load_(module: nn.Module, state_dict: dict[str, Any], prefix: str = "") -> list[str]:
    """Give every layer of ``module`` whose weight is quantized but whose incoming weight (``state_dict``,
    under ``prefix``) is float a float ``nn.Parameter`` (its dequantized weight), so the float values load in
    place. Returns the names of those layers, to :func:`requantize_` after loading.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4))
        >>> float_weights_for_load_(model, {"0.weight": torch.zeros(4, 4)})  # nothing quantized: nothing to do
        []
    """
    floats: dict[int, nn.Parameter] = {}
    names = []
    for fqn, layer in module.named_modules():
        weight = getattr(layer, "weight", None)
        incoming = state_dict.get(f"{prefix}{fqn}.weight")
        if incoming is None or not is_quantized_tensor(weight) or is_quantized_tensor(incoming):
            continue
        if id(weight) not in floats:
            floats[id(weight)] = nn.Parameter(weight.dequantize().to(torch.float32))
        layer.weight = floats[id(weight)]
        layer.__dict__.pop("extra_repr", None)  # torchao patches the instance's extra_repr
        names.append(fqn)
    return names


def requantize_(module: nn.Module, names: Sequence[str], config: Any) -> None:
    """Quantize the layers ``names`` of ``module`` with the torchao ``config``; a tied group among them is
    quantized once (through its ``nn.Linear`` member) and the one tensor is shared by the group again."""
    groups = [group for group in tied_groups(module) if set(group) & set(names)]
    in_groups = {name for group in groups for name in group}
    convs = [name for name in names if isinstance(module.get_submodule(name), nn.Conv2d)]
    quantize_conv2d_(module, convs)  # int8 per output channel, whatever the config (no torchao config takes them)
    apply_config(module, config, [name for name in names if name not in in_groups and name not in convs])
    for group in groups:  # quantized once, shared again
        head = next((name for name in group if isinstance(module.get_submodule(name), nn.Linear)), group[0])
        apply_config(module, config, [head], type(module.get_submodule(head)))
        for name in group:
            module.get_submodule(name).weight = module.get_submodule(head).weight
