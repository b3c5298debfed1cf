"""int8 weights for ``nn.Conv2d``: what makes a CNN ship about 4x smaller with the in-place int8 modes.

torchao 0.18 has no ``Conv2d`` path in ``Int8WeightOnlyConfig`` / ``Int8DynamicActivationInt8WeightConfig``
(``quantize_`` leaves convolutions float, so a CNN shipped 1.00x smaller), and its ``IntxWeightOnlyConfig``
takes a 4-D weight but scales it per output channel *and kernel position* (blocks ``(1, C_in, 1, 1)``: one
float32 scale and one int8 zero point per ``C_in`` weights, 2.9x smaller on a width-16 ResNet). Here each
``Conv2d`` weight becomes a torchao ``IntxUnpackedToInt8Tensor`` with one symmetric scale per **output
channel** (blocks ``(1, C_in / groups, kH, kW)``): int8 values, one float32 scale and one int8 zero point
(all 0) per output channel. torchao's own ``conv2d`` implementation for that tensor dequantizes it and runs
the float convolution, so the layer is weight-only int8 in every int8 mode (activations stay float, also
in ``int8_dynamic``), runs in train / eval / ``no_grad`` / ``inference_mode``, and its state dict saves
and loads through the same portable path as every other torchao weight
(:mod:`~lightning_lowmem.functional.quantization.serialization`,
:func:`lightning_lowmem.checkpoints.quantized.prepare_for_load`).

Nothing here imports Lightning; torchao is imported inside the functions.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from lightning_lowmem.functional.quantization.serialization import keep_portable_

__all__ = ["CONV_MODES", "conv_int8_weight", "is_quantizable_conv", "quantize_conv2d_"]

#: the modes that quantize ``nn.Conv2d`` weights (weight-only int8, per output channel)
CONV_MODES = ("int8_dynamic", "int8_weight_only")


def is_quantizable_conv(layer: nn.Module, mode: str) -> bool:
    """An ``nn.Conv2d`` with a plain float weight, in a mode of :data:`CONV_MODES`."""
    if mode not in CONV_MODES or not isinstance(layer, nn.Conv2d):
        return False
    weight = layer.weight
    return type(weight.data) in (torch.Tensor, nn.Parameter) and weight.is_floating_point()


def conv_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``(C_out, C_in / groups, kH, kW)``) as a torchao ``IntxUnpackedToInt8Tensor``: int8 values,
    one symmetric scale per output channel.

    Example::

        >>> weight = torch.randn(8, 4, 3, 3)
        >>> quantized = conv_int8_weight(weight)
        >>> quantized.qdata.dtype, tuple(quantized.scale.shape)
        (torch.int8, (8, 1, 1, 1))
        >>> bool((quantized.dequantize() - weight).abs().max() <= quantized.scale.max() / 2 + 1e-6)
        True
    """
    from torchao.quantization import IntxUnpackedToInt8Tensor

    if weight.dim() != 4:
        raise ValueError(
            f"`weight` must be a 4-D Conv2d weight (C_out, C_in / groups, kH, kW), got shape {tuple(weight.shape)}."
        )
    return IntxUnpackedToInt8Tensor.from_hp(weight.detach(), (1, *weight.shape[1:]), torch.int8)


def quantize_conv2d_(module: nn.Module, names: Sequence[str]) -> list[str]:
    """Give the ``nn.Conv2d`` layers ``names`` of ``module`` int8 weights (:func:`conv_int8_weight`), in place;
    layers sharing one weight share the quantized one. Returns ``names``.

    Example::

        >>> model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3))
        >>> x = torch.randn(2, 3, 8, 8)
        >>> reference = model(x)
        >>> quantize_conv2d_(model, ["0", "2"])
        ['0', '2']
        >>> type(model[2].weight).__name__, bool((model(x) - reference).abs().max() < 0.01)
        ('IntxUnpackedToInt8Tensor', True)
    """
    quantized: dict[int, nn.Parameter] = {}
    for name in names:
        layer = module.get_submodule(name)
        if not isinstance(layer, nn.Conv2d):
            raise TypeError(f"layer {name!r} is a {type(layer).__name__}, not an nn.Conv2d.")
        weight = layer.weight
        if id(weight) not in quantized:
            quantized[id(weight)] = nn.Parameter(conv_int8_weight(weight), requires_grad=False)
        layer.weight = quantized[id(weight)]
    if names:
        keep_portable_(module)
    return list(names)
