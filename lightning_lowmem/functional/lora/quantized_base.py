"""QLoRA's storage side: quantizing the frozen base of a LoRA model with torchao (used by ``functional.lora``).

Kept apart from the adapter logic in ``lora.py``: these helpers only decide which frozen weights are
stored in which torchao format, and check the backend can run that format before anything is wrapped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def is_quantized(weight: torch.Tensor) -> bool:
    """A torchao quantized tensor subclass (it flattens into inner tensors; see :func:`dequantized`)."""
    return type(weight) not in (torch.Tensor, nn.Parameter) and hasattr(weight, "__tensor_flatten__")


def dequantized(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A plain float copy of a quantized ``weight`` (out, in), in ``dtype`` (default: the weight's).

    torchao's int4 tinygemm format (``Int4TilePackedTo4dTensor``) has no ``dequantize``; its own kernel
    gives it back: ``linear(I, W) = W^T``.
    """
    if type(weight).dequantize is not torch.Tensor.dequantize:  # the format's own (torch's is for torch.ao qtensors)
        dense = weight.dequantize()
    else:
        eye = torch.eye(weight.shape[1], dtype=weight.dtype, device=weight.device)  # (in, in)
        dense = F.linear(eye, weight).t()  # (out, in)
    return dense if dtype is None else dense.to(dtype)


class _FrozenQuantizedLinear(torch.autograd.Function):
    """``F.linear`` with a frozen quantized weight. torchao's kernels need not be differentiable (int4
    tinygemm's ``_weight_int4pack_mm`` is not) and int8 weight-only saves a float copy of the weight for
    backward; here backward computes the input's gradient from a transient dequantized weight, one layer
    at a time, and nothing weight-sized is kept from forward to backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)  # a parameter: compression / offload hooks keep it as it is
        ctx.x_dtype = x.dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        (weight,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(dequantized(weight, grad_out.dtype)).to(ctx.x_dtype)  # (..., in)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, grad_bias


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; for a quantized ``weight`` whose input needs a gradient, through
    :class:`_FrozenQuantizedLinear` (QLoRA's frozen base)."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    if not needs_grad or not is_quantized(weight) or weight.requires_grad:
        return F.linear(x, weight, bias)
    return _FrozenQuantizedLinear.apply(x, weight, bias)


def torchao_config(quantize_base: str, in_features: int) -> Any:
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    except ImportError as err:  # pragma: no cover - torchao is a dependency
        raise ImportError("`quantize_base` needs torchao: `pip install torchao`.") from err
    from lightning_lowmem._versions import require

    require("torchao", "LoRA's `quantize_base`")
    if quantize_base == "int8":
        return Int8WeightOnlyConfig()
    group_size = next((g for g in (128, 64, 32) if in_features % g == 0), None)
    if group_size is None:
        raise ValueError(f"`quantize_base`='int4' needs in_features divisible by 32; a layer has {in_features}.")
    from torchao.quantization.quantize_.workflows.int4.int4_packing_format import Int4PackingFormat

    # the tinygemm format (CUDA, bf16 weights): torchao's default 'plain' format needs the separate `mslk`
    # kernels, which torchao does not install; functional.quantization's int4_weight_only uses the same
    return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D)


def _bf16_for_int4(layer: nn.Module, quantize_base: str) -> None:
    """int4 (tinygemm) packs bf16 weights only: store a float weight as bf16 first (frozen, so no update
    is lost; the kernel casts activations to bf16 and its output back to theirs)."""
    if quantize_base == "int4" and layer.weight.dtype != torch.bfloat16:
        layer.weight = nn.Parameter(layer.weight.detach().to(torch.bfloat16), requires_grad=False)


def quantize_base_layers_(module: nn.Module, layers: dict[str, nn.Linear], quantize_base: str) -> None:
    """Quantize the base weights of ``layers`` (qualified name -> adapter layer of ``module``), frozen."""
    from torchao.quantization import quantize_

    from lightning_lowmem.functional.quantization.modes import drop_zero_point

    for name, layer in layers.items():  # one config per layer: int4's group size depends on in_features
        config = torchao_config(quantize_base, layer.in_features)
        _bf16_for_int4(layer, quantize_base)
        quantize_(module, config, filter_fn=lambda sub, fqn, name=name: fqn == name and sub is layers[name])
        drop_zero_point(layer.weight)  # int8: torchao's all-zero symmetric zero points, one byte per row
        layer.weight.requires_grad_(False)


def check_quantization_supported(quantize_base: str, example: nn.Module) -> None:
    """Quantize a small probe layer like ``example`` first, so an unsupported backend wraps nothing."""
    weight = example.weight
    in_features = 256
    probe = nn.Sequential(nn.Linear(in_features, 64, device=weight.device, dtype=weight.dtype))
    probe.requires_grad_(False)
    try:
        from torchao.quantization import quantize_

        _bf16_for_int4(probe[0], quantize_base)
        quantize_(probe, torchao_config(quantize_base, in_features))
        probe(torch.zeros(1, in_features, device=weight.device, dtype=weight.dtype))
    except Exception as err:
        import torchao

        raise RuntimeError(
            f"`quantize_base`={quantize_base!r} is not supported by torchao {torchao.__version__} for "
            f"{weight.dtype} weights on device {weight.device.type!r}: {type(err).__name__}: {err}. "
            f"Nothing was wrapped. Hint: use quantize_base='int8' (works on CPU and CUDA) or run int4 on a "
            f"CUDA GPU with torchao's int4 kernels installed."
        ) from err


def quantize_frozen_(module: nn.Module, quantize_base: str, adapter_type: type[nn.Module]) -> list[str]:
    """Quantize the frozen, unshared weights of plain linear layers and embedding tables (not adapters)."""
    from torchao.quantization import quantize_

    from lightning_lowmem.functional.quantization.modes import embedding_config

    owners: dict[int, int] = {}
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        if isinstance(weight, torch.Tensor):
            owners[id(weight)] = owners.get(id(weight), 0) + 1
    done = []
    for name, sub in list(module.named_modules()):
        weight = getattr(sub, "weight", None)
        if isinstance(sub, adapter_type) or not isinstance(weight, torch.Tensor) or weight.requires_grad:
            continue
        if owners[id(weight)] > 1 or is_quantized(weight):
            continue
        if type(sub) is nn.Linear and (quantize_base == "int8" or sub.in_features % 32 == 0):
            config = torchao_config(quantize_base, sub.in_features)
            _bf16_for_int4(sub, quantize_base)
        elif type(sub) is nn.Embedding and sub.max_norm is None:
            config = embedding_config("int8_weight_only" if quantize_base == "int8" else "intx4_weight_only")
        else:
            continue
        quantize_(module, config, filter_fn=lambda m, fqn, name=name: fqn == name)
        sub.weight.requires_grad_(False)
        done.append(name)
    return done
