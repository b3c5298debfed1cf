"""Quantization-aware training on torchao: fake-quantized ``nn.Linear`` layers (``QATConfig`` prepare),
then real quantized weights (``QATConfig`` convert).

``transformers``' ``Conv1D`` layers are replaced by exact ``nn.Linear`` layers first
(:func:`~lightning_lowmem.functional.quantization.layers.conv1d_to_linear`), so GPT-2 trains with its
attention and MLP weights fake-quantized like any other model. A head whose weight is tied to a token
table is fake-quantized like any Linear during training (the lookup reads the float table); at convert the
one tied tensor is quantized once, in the head's format, and shared by the table again (stored once).
Embedding tables that are not tied stay float. Nothing here imports Lightning.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_lowmem.functional.quantization.ptq import quantizable_layers, warn_mha_left_float
from lightning_lowmem.functional.quantization.report import (
    MIN_CONVERTED_SHARE,
    QuantizationReport,
    float_bytes_by_class,
    weight_bytes,
)
from lightning_lowmem.functional.quantization.layers import (
    check_patterns,
    convert_conv1d_,
    is_conv1d,
    set_submodule,
    tied_groups,
)
from lightning_lowmem.functional.quantization.modes import (
    unsupported_reason,
    apply_config,
    embedding_config,
)
from lightning_lowmem.functional.config.constants import GROUP_SIZE, QAT_MODES
from lightning_lowmem.functional.config.qat import QATConfig
from lightning_lowmem.functional.config.techniques import QuantizationConfig
from lightning_lowmem.memory.measure import state_bytes

__all__ = ["QAT_MODES", "convert_qat_", "prepare_qat_", "qat_coverage_warning", "qat_layers", "set_fake_quant_enabled"]


def qat_base_config(mode: str, group_size: int) -> Any:
    """Base config QAT trains for; int8 weight-only QAT goes through torchao's Intx config (QATConfig
    does not take Int8WeightOnlyConfig): int8 per row, the same format as an int8 embedding table."""
    if mode == "int8_weight_only":
        import torchao.quantization as tq

        return tq.IntxWeightOnlyConfig(weight_dtype=torch.int8)
    return QuantizationConfig(mode, group_size).torchao_config()


def _fake_quantized_type() -> type:
    from torchao.quantization.qat import FakeQuantizedLinear

    return FakeQuantizedLinear


def qat_layers(
    module: nn.Module,
    mode: str | QATConfig,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    skip_modules: Sequence[str] = (),
    group_size: int = GROUP_SIZE,
) -> list[str]:
    """Names of the ``nn.Linear`` / ``Conv1D`` layers :func:`prepare_qat_` would prepare (tied heads included;
    torchao 0.18 has no fake-quantized ``nn.Conv2d``: convolutions stay float)."""
    config = QATConfig.of(mode, filter_fn=filter_fn, skip_modules=skip_modules, group_size=group_size)
    mode, filter_fn, skip_modules, group_size = config.mode, config.filter_fn, config.skip_modules, config.group_size
    names = quantizable_layers(
        module, mode, filter_fn=filter_fn, skip_modules=skip_modules, group_size=group_size, embeddings=True
    )
    return [name for name in names if not isinstance(module.get_submodule(name), (nn.Embedding, nn.Conv2d))]


def prepare_qat_(
    module: nn.Module,
    mode: str | QATConfig,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    skip_modules: Sequence[str] = (),
    group_size: int = GROUP_SIZE,
) -> list[str]:
    """Swap the chosen ``nn.Linear`` (and ``Conv1D``) layers for torchao fake-quantized ones (``QATConfig``
    prepare).

    ``nn.Linear`` weights stay the same ``nn.Parameter`` objects, so an optimizer created before still
    updates them; a ``Conv1D`` becomes an exact ``nn.Linear`` first, whose weight is a new
    ``nn.Parameter`` (a transposed view of the same storage): create the optimizer after this call.

    Args:
        module: the model.
        mode: a :class:`~lightning_lowmem.functional.config.QATConfig` (its ``filter_fn``, ``skip_modules`` and
            ``group_size`` apply), or its shorthand: one of :data:`QAT_MODES` with the arguments below, which
            builds one (every check is the config's).
        filter_fn: ``filter_fn(layer, fqn) -> bool`` chooses layers. Default: ``None``.
        skip_modules: submodules kept in float (names, dotted suffixes, globs or class names). Default: ``()``.
        group_size: group length of the int4 modes. Default: ``GROUP_SIZE`` (32).

    Returns:
        The names of the layers prepared.

    Raises:
        ValueError: unknown ``mode``, a mode the device cannot run, a ``skip_modules`` entry naming nothing;
            shorthand arguments beside a config.

    Example::

        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        >>> prepare_qat_(model, "intx4_weight_only")
        ['0', '2']
        >>> convert_qat_(model, "intx4_weight_only").converted
        ['0', '2']
    """
    config = QATConfig.of(mode, filter_fn=filter_fn, skip_modules=skip_modules, group_size=group_size)
    mode, filter_fn, skip_modules, group_size = config.mode, config.filter_fn, config.skip_modules, config.group_size
    device = next((p.device.type for p in module.parameters()), "cpu")
    reason = unsupported_reason(mode, device)
    if reason is not None:
        raise ValueError(f"`mode`={mode!r} cannot run on device {device!r}: {reason}")
    from torchao.quantization.qat import QATConfig as TorchaoQATConfig

    check_patterns(module, skip_modules, "skip_modules", qat_layers(module, mode, group_size=group_size))
    fake = _fake_quantized_type()
    names = [
        fqn
        for fqn in qat_layers(module, mode, filter_fn=filter_fn, skip_modules=skip_modules, group_size=group_size)
        if not isinstance(module.get_submodule(fqn), fake)
    ]
    warn_mha_left_float(module, f"prepare_qat_(mode={mode!r})", stacklevel=2)
    convert_conv1d_(module, [name for name in names if is_conv1d(module.get_submodule(name))])
    if names:
        apply_config(module, TorchaoQATConfig(qat_base_config(mode, group_size), step="prepare"), names)
    return names


def qat_coverage_warning(module: nn.Module, names: Sequence[str], mode: str) -> str | None:
    """Why QAT of the layers ``names`` leaves most of ``module`` float (under half of its parameter bytes
    covered: a CNN's ``nn.Conv2d`` weights, which torchao 0.18 cannot fake-quantize), or ``None``. Said when
    QAT is set up, not after training.

    Example::

        >>> convnet = nn.Sequential(nn.Conv2d(3, 64, 3))
        >>> print(qat_coverage_warning(convnet, [], "int8_weight_only"))  # doctest: +ELLIPSIS
        QAT (mode='int8_weight_only') fake-quantizes 0 layers holding 0% of Sequential's parameter bytes; ...
    """
    total = state_bytes(module)["parameters"]
    covered = weight_bytes(module, names) if names else 0
    if not total or covered >= MIN_CONVERTED_SHARE * total:
        return None
    convs = sum(1 for layer in module.modules() if isinstance(layer, nn.Conv2d))
    rest = float_bytes_by_class(module, names) or "none"
    return (
        f"QAT (mode={mode!r}) fake-quantizes {len(names)} layers holding {100 * covered / total:.0f}% of "
        f"{type(module).__name__}'s parameter bytes; the float rest is in {rest}. "
        "QAT covers nn.Linear and transformers' Conv1D only (torchao 0.18 has no fake-quantized convolution)"
        + (
            f": the {convs} nn.Conv2d layers train in float. Quantize them after training with "
            "PostTrainingQuantization('int8_weight_only') (int8 per output channel)."
            if convs
            else "."
        )
    )


def set_fake_quant_enabled(module: nn.Module, enabled: bool) -> int:
    """Turn torchao fake quantizers on/off (a disabled one returns its input). Returns how many."""
    from torchao.quantization.qat import FakeQuantizerBase

    count = 0
    for child in module.modules():
        if isinstance(child, FakeQuantizerBase):
            child.enabled = enabled
            count += 1
    return count


def convert_qat_(module: nn.Module, mode: str | QATConfig, *, group_size: int = GROUP_SIZE) -> QuantizationReport:
    """Swap fake-quantized layers back to ``nn.Linear`` and quantize them for real (``QATConfig``
    convert); a weight tied to other layers (a token table) is quantized once and shared again.

    Returns:
        A :class:`~lightning_lowmem.functional.quantization.QuantizationReport` of the converted layers
        (``converted`` includes the tables sharing a converted weight, ``tied`` their groups).
    """
    config = QATConfig.of(mode, group_size=group_size)
    mode, group_size = config.mode, config.group_size
    from torchao.quantization.qat import QATConfig as TorchaoQATConfig

    fake = _fake_quantized_type()
    names = [fqn for fqn, layer in module.named_modules() if isinstance(layer, fake)]
    groups = [group for group in tied_groups(module) if set(group) & set(names)]
    bytes_before = state_bytes(module)["parameters"]
    converted_bytes = weight_bytes(module, names)
    # packed int4 (CUDA) has no lookup: a tied weight takes the embedding format of the same int4 values
    tied_heads = {name for group in groups for name in group if name in names} if mode == "int4_weight_only" else set()
    plain = [name for name in names if name not in tied_heads]
    if plain:
        apply_config(module, TorchaoQATConfig(qat_base_config(mode, group_size), step="convert"), plain)
    for name in tied_heads:
        set_submodule(module, name, module.get_submodule(name).to_linear())
    if tied_heads:
        apply_config(module, embedding_config(mode, group_size=group_size), sorted(tied_heads))
    for group in groups:
        weight = module.get_submodule(next(name for name in group if name in names)).weight
        for name in group:
            module.get_submodule(name).weight = weight
    converted = sorted(set(names) | {name for group in groups for name in group}, key=_order(module))
    return QuantizationReport(
        mode, bytes_before, state_bytes(module)["parameters"], converted, module, [], groups, converted_bytes
    )


def _order(module: nn.Module) -> Callable[[str], int]:
    positions = {name: index for index, (name, _) in enumerate(module.named_modules(remove_duplicate=False))}
    return lambda name: positions.get(name, len(positions))
