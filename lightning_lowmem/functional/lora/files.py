"""Adapters-only files: :func:`save_adapters` writes a LoRA model's adapter tensors with the settings that rebuild
them (:func:`lora_config`), :func:`load_adapters` reads them (or a Lightning checkpoint's) into a module, wrapping
its layers first when needed. The base weights never go into these files.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch
from torch import nn

from lightning_lowmem.functional.lora.adapters import (
    ADAPTER_SUFFIXES,
    RUNNING_STAT_SUFFIXES,
    LoraReport,
    count_parameters,
    is_candidate,
    check_lora_arguments,
    wrap_layers,
    lora_layers,
    train_in_full_,
    trained_modules,
)
from lightning_lowmem.functional.lora.quantized_base import is_quantized

__all__ = ["FILE_FORMAT", "export_root", "load_adapters", "lora_config", "lora_state_dict", "save_adapters"]

FILE_FORMAT = "lightning_lowmem.lora/1"


def export_root(module: nn.Module) -> tuple[str, nn.Module]:
    """``(name, model)`` whose keys exported weights use: the one Hugging Face model (it has ``config`` and
    ``save_pretrained``) that holds all of a wrapper's state (a LightningModule's ``self.model``), so the file loads
    with ``strict=True`` into ``LlamaForCausalLM(config)`` itself; else ``("", module)``, the wrapper's own keys.

    Example::

        >>> export_root(nn.Sequential(nn.Linear(2, 2)))[0]
        ''
    """
    keys = list(module.state_dict())
    for name, child in module.named_children():
        if hasattr(child, "save_pretrained") and hasattr(child, "config"):
            if keys and all(key.startswith(name + ".") for key in keys):
                return name, child
    return "", module


def lora_config(module: nn.Module) -> dict[str, Any]:
    """The settings needed to rebuild ``module``'s adapters: layer names, rank, alpha, dropout, quantization.

    Raises:
        ValueError: ``module`` has no LoRA layers.
    """
    layers = lora_layers(module)
    if not layers:
        raise ValueError(f"{type(module).__name__} has no LoRA layers: call apply_lora_ first.")
    first = next(iter(layers.values()))
    dropouts = [getattr(layer, "lora_dropout", None) for layer in layers.values()]  # attentions have none
    dropout = next((d.p for d in dropouts if isinstance(d, nn.Dropout)), 0.0)
    quantized = {is_quantized(layer.weight) for layer in layers.values()}
    quantize_base = None
    if True in quantized:
        name = type(first.weight).__name__.lower()
        quantize_base = "nf4" if "nf4" in name else "int4" if "int4" in name else "int8"
    return {
        "target": list(layers),
        "r": first.r,
        "alpha": first.alpha,
        "dropout": dropout,
        "quantize_base": quantize_base,
        "train_modules": trained_modules(module),
    }


def lora_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """What LoRA trains: the adapter tensors (``<layer>.lora_A`` / ``<layer>.lora_B``), the tensors of the
    modules trained in full (``train_modules``) and the running statistics of BatchNorm layers (which training
    updates), detached, keyed as in ``state_dict()``."""
    trained = tuple(f"{name}." for name in trained_modules(module))
    return {
        key: value.detach()
        for key, value in module.state_dict().items()
        if key.endswith(ADAPTER_SUFFIXES + RUNNING_STAT_SUFFIXES) or key.startswith(trained)
    }


def save_adapters(module: nn.Module, path: str | os.PathLike) -> None:
    """Write adapter tensors and :func:`lora_config` to ``path`` (read back by :func:`load_adapters`)."""
    torch.save({"format": FILE_FORMAT, "lora_config": lora_config(module), "state_dict": lora_state_dict(module)}, path)


def _read(
    source: str | os.PathLike | dict[str, Any], weights_only: bool
) -> tuple[dict[str, torch.Tensor], dict | None]:
    payload = source if isinstance(source, dict) else torch.load(source, map_location="cpu", weights_only=weights_only)
    config = payload.get("lora_config")
    state = payload.get("state_dict", payload)
    for callback_state in (payload.get("callbacks") or {}).values():  # a Lightning checkpoint
        if isinstance(callback_state, dict) and "lora_config" in callback_state:
            config = config or callback_state["lora_config"]
    adapters = {k: v for k, v in state.items() if isinstance(k, str) and k.endswith(ADAPTER_SUFFIXES)}
    trained = tuple(f"{name}." for name in (config or {}).get("train_modules") or ())
    adapters.update({k: v for k, v in state.items() if isinstance(k, str) and trained and k.startswith(trained)})
    adapters.update({k: v for k, v in state.items() if isinstance(k, str) and k.endswith(RUNNING_STAT_SUFFIXES)})
    return adapters, config


def _layer_name(prefix: str, names: Iterable[str]) -> str | None:
    """Map a checkpoint's layer prefix to a layer of the module (checkpoints may add leading components)."""
    names = set(names)
    parts = prefix.split(".")
    for start in range(len(parts)):
        candidate = ".".join(parts[start:])
        if candidate in names:
            return candidate
    return None


def load_adapters(
    module: nn.Module,
    source: str | os.PathLike | dict[str, Any],
    *,
    alpha: float | None = None,
    quantize_base: str | None = None,
    weights_only: bool = True,
) -> LoraReport:
    """Load adapter weights into ``module``, wrapping its layers first when it has no adapters yet.

    ``source`` is a file from :func:`save_adapters`, a Lightning checkpoint written with the
    ``LowRankAdapters`` callback, or a state dict (adapter keys are picked out). Keys may carry extra
    leading components (e.g. ``model.`` of a LightningModule) when ``module`` is the inner model.

    Args:
        module: a fresh base model (wrapped here, rank taken from the tensors' shapes) or one already
            wrapped by :func:`apply_lora_`.
        source: path or loaded dict.
        alpha: override the stored alpha (needed when ``source`` is a bare state dict). Default: stored
            value, else ``2 * r``.
        quantize_base: quantize the base when wrapping here. Default: the stored setting, else ``None``.
        weights_only: passed to ``torch.load``. Default: ``True``.

    Returns:
        A :class:`LoraReport` of the module's adapters after loading.

    Raises:
        ValueError: ``source`` holds no adapter tensors, or its layers / shapes do not fit ``module``.
    """
    adapters, config = _read(source, weights_only)
    config = dict(config or {})
    full = {key: adapters.pop(key) for key in [k for k in adapters if not k.endswith(ADAPTER_SUFFIXES)]}
    if not adapters:
        raise ValueError("`source` holds no adapter tensors (keys ending in .lora_A / .lora_B).")
    prefixes = sorted({key.rsplit(".", 1)[0] for key in adapters})
    if not lora_layers(module):
        candidates = {name: sub for name, sub in module.named_modules() if is_candidate(sub)}
        mapping = {p: _layer_name(p, candidates) for p in prefixes}
        missing = [p for p, name in mapping.items() if name is None]
        if missing:
            raise ValueError(
                f"adapters for {missing[:4]} fit no nn.Linear / Conv1D layer of {type(module).__name__}; "
                f"its layers are {sorted(candidates)[:8]}"
            )
        r = int(adapters[f"{prefixes[0]}.lora_A"].shape[0])
        alpha = alpha if alpha is not None else config.get("alpha", 2 * r)
        check_lora_arguments(r, alpha, config.get("dropout", 0.0), quantize_base or config.get("quantize_base"))
        wrap_layers(
            module,
            {mapping[p]: candidates[mapping[p]] for p in prefixes},
            r=r,
            alpha=alpha,
            dropout=config.get("dropout", 0.0),
            quantize_base=quantize_base or config.get("quantize_base"),
            freeze_base=True,
        )
    layers = lora_layers(module)
    mapping = {p: _layer_name(p, layers) for p in prefixes}
    unmatched = sorted(set(layers) - set(mapping.values()))
    if None in mapping.values() or unmatched:
        raise ValueError(
            f"adapter layers do not match: in `source` only {[p for p, n in mapping.items() if n is None][:4]}, "
            f"in module only {unmatched[:4]}"
        )
    with torch.no_grad():
        for prefix, name in mapping.items():
            layer = layers[name]
            for part in ("lora_A", "lora_B"):
                tensor = adapters[f"{prefix}.{part}"]
                param = getattr(layer, part)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{prefix}.{part} has shape {tuple(tensor.shape)}, layer {name!r} needs {tuple(param.shape)}"
                    )
                param.copy_(tensor)
            if alpha is not None:
                layer.alpha, layer.scaling = alpha, alpha / layer.r
    _load_trained(module, full, config.get("train_modules") or [])
    _load_running_stats(module, {k: v for k, v in full.items() if k.endswith(RUNNING_STAT_SUFFIXES)})
    trainable, total = count_parameters(module)
    cfg = lora_config(module)
    return LoraReport(
        wrapped=list(layers),
        trained=cfg["train_modules"],
        r=cfg["r"],
        alpha=float(cfg["alpha"]),
        quantize_base=cfg["quantize_base"],
        trainable_params=trainable,
        total_params=total,
    )


def _load_trained(module: nn.Module, tensors: dict[str, torch.Tensor], names: list[str]) -> None:
    """Copy the tensors of the modules trained in full (saved as ``<name>.<tensor>``) into ``module``, and train them."""
    modules = dict(module.named_modules())
    own = module.state_dict(keep_vars=True)
    mapped = []
    for name in names:
        target = _layer_name(name, modules)
        if target is None:
            raise ValueError(
                f"`source` trains module {name!r} in full, which {type(module).__name__} does not have; "
                f"its modules are e.g. {sorted(n for n in modules if n)[:8]}"
            )
        mapped.append(target)
        for key, tensor in tensors.items():
            if not key.startswith(f"{name}."):
                continue
            dest = f"{target}.{key[len(name) + 1 :]}" if target else key[len(name) + 1 :]
            if dest not in own or tuple(own[dest].shape) != tuple(tensor.shape):
                raise ValueError(f"{key} (shape {tuple(tensor.shape)}) fits no tensor of {target!r} in the module")
            with torch.no_grad():
                own[dest].copy_(tensor)
    train_in_full_(module, [name for name in mapped if name not in trained_modules(module)])


def _load_running_stats(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy saved BatchNorm running statistics into the matching buffers of ``module`` (keys may carry extra
    leading components, as adapter keys may)."""
    buffers = dict(module.named_buffers())
    for key, tensor in tensors.items():
        dest = _layer_name(key, buffers)
        if dest is None or tuple(buffers[dest].shape) != tuple(tensor.shape):
            shape = tuple(tensor.shape)
            raise ValueError(f"running statistic {key} (shape {shape}) fits no buffer of {type(module).__name__}")
        with torch.no_grad():
            buffers[dest].copy_(tensor)
