"""QLoRA's storage side: quantizing the frozen base of a LoRA model with torchao (used by ``functional.lora``).

Kept apart from the adapter logic in ``lora.py``: these helpers only decide which frozen weights are
stored in which torchao format, and check the backend can run that format before anything is wrapped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def is_quantized(weight: torch.Tensor) -> bool:
    """A torchao quantized tensor subclass (it can ``dequantize`` and flattens into inner tensors)."""
    return type(weight) not in (torch.Tensor, nn.Parameter) and hasattr(weight, "dequantize") and hasattr(
        weight, "__tensor_flatten__"
    )


def torchao_config(quantize_base: str, in_features: int) -> Any:
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    except ImportError as err:  # pragma: no cover - torchao is a dependency
        raise ImportError("`quantize_base` needs torchao: `pip install torchao`.") from err
    if quantize_base == "int8":
        return Int8WeightOnlyConfig()
    group_size = next((g for g in (128, 64, 32) if in_features % g == 0), None)
    if group_size is None:
        raise ValueError(f"`quantize_base`='int4' needs in_features divisible by 32; a layer has {in_features}.")
    return Int4WeightOnlyConfig(group_size=group_size)


def quantize_base_layers_(module: nn.Module, layers: dict[str, nn.Linear], quantize_base: str) -> None:
    """Quantize the base weights of ``layers`` (qualified name -> adapter layer of ``module``), frozen."""
    from torchao.quantization import quantize_

    from lightning_lowmem.functional.quantization import drop_zero_point

    for name, layer in layers.items():  # one config per layer: int4's group size depends on in_features
        config = torchao_config(quantize_base, layer.in_features)
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

    from lightning_lowmem.functional.quantization import embedding_config

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
        elif type(sub) is nn.Embedding and sub.max_norm is None:
            config = embedding_config("int8_weight_only" if quantize_base == "int8" else "intx4_weight_only")
        else:
            continue
        quantize_(module, config, filter_fn=lambda m, fqn, name=name: fqn == name)
        sub.weight.requires_grad_(False)
        done.append(name)
    return done
