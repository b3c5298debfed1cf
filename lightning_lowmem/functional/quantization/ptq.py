"""Post-training quantization of ``nn.Linear``, ``transformers``' ``Conv1D`` and ``nn.Embedding`` layers on torchao.

Every mode is a torchao config applied with ``torchao.quantization.quantize_`` (weights are swapped
in place for torchao tensor subclasses); static int8 goes through ``torchao.quantization.pt2e`` and
lives in :mod:`lightning_lowmem.functional.quantization.static`, quantization-aware training in
:mod:`lightning_lowmem.functional.quantization.qat`. Nothing here imports Lightning.

Models as users bring them (:mod:`lightning_lowmem.functional.quantization.layers`):

- GPT-2's ``Conv1D`` layers are replaced by exact ``nn.Linear`` layers (a transposed view of the same
  weight: bit-identical outputs) and quantized as such.
- Weights tied between layers (GPT-2 / BERT / T5's output head and token table) are quantized **once**,
  weight-only, in the embedding format (:func:`embedding_config`: int8 per row, or int4 values in groups),
  and the one quantized tensor is shared again: the tie holds, the table is stored once, the lookup and
  the head both read it. So in ``int8_dynamic`` a tied head runs weight-only int8 (float activations);
  an untied head (Llama) gets the mode's own format. A tied group is quantized whole or not at all
  (``skip_modules`` / ``filter_fn`` / ``embeddings=False`` naming one member keep the whole group float).

Embedding tables (``nn.Embedding``) take indices, not activations, so every in-place mode quantizes
them weight-only with torchao's ``IntxWeightOnlyConfig`` (see :func:`embedding_config`). They are
included by default (``embeddings=None``); ``int8_static`` leaves them float.

Modes (see :func:`available_modes` for what runs on a device):

- ``"int8_dynamic"``: int8 weights (per row) and int8 activations quantized on the fly.
- ``"int8_weight_only"``: int8 weights (per row), float activations.
- ``"int4_weight_only"``: packed int4 weights (groups of ``group_size``); needs CUDA + bf16.
- ``"intx4_weight_only"``: int4 *values* in groups of ``group_size``, stored one per int8 byte:
  int4 accuracy on any device (CPU included) at int8 size. Use it where ``int4_weight_only`` is not
  supported, e.g. to measure int4 accuracy or run int4 QAT on CPU.
- ``"int8_static"``: int8 weights and activations with calibrated scales (pt2e export); returns a
  new exported module (``report.module``), the input module is left untouched.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from lightning_lowmem.functional.multihead_attention import left_alone_message, mha_out_projections
from lightning_lowmem.functional.config.constants import GROUP_SIZE
from lightning_lowmem.functional.config.techniques import QuantizationConfig
from lightning_lowmem.functional.quantization.conv import is_quantizable_conv, quantize_conv2d_
from lightning_lowmem.functional.quantization.layers import (
    check_patterns,
    convert_conv1d_,
    is_conv1d,
    matches_any,
    set_submodule,
    tied_groups,
)
from lightning_lowmem.functional.quantization.modes import (  # re-exported: part of this module's API
    MODES,
    include_embeddings,
    needs_group,
    unsupported_reason,
    apply_config,
    available_modes,
    drop_zero_point,
    drop_zero_points_,
    embedding_config,
    torchao_config,
)
from lightning_lowmem.functional.quantization.search import (  # re-exported: part of this module's API
    ToleranceSearchResult,
    measure_latency,
    search_float_fallback,
)
from lightning_lowmem.functional.quantization.report import QuantizationReport, warn_if_mostly_float, weight_bytes
from lightning_lowmem.memory.measure import state_bytes
from lightning_lowmem.warnings import LowMemWarning, NoEffectWarning

__all__ = [
    "MODES",
    "QuantizationReport",
    "ToleranceSearchResult",
    "available_modes",
    "dequantize_",
    "drop_zero_point",
    "drop_zero_points_",
    "embedding_config",
    "measure_latency",
    "quantizable_layers",
    "quantize_",
    "search_float_fallback",
    "temporarily_quantized",
]


def _eligible(layer: nn.Module, mode: str, with_embeddings: bool, group_size: int) -> bool:
    """A layer ``mode`` can quantize: Linear / Conv1D (/ Embedding without ``max_norm``, which renormalizes
    the table in place) with a plain float weight, whose width fits the int4 group size; in the int8 modes an
    ``nn.Conv2d`` with a float weight too (:mod:`~lightning_lowmem.functional.quantization.conv`)."""
    if is_quantizable_conv(layer, mode):
        return True
    if isinstance(layer, nn.Linear):
        width = layer.in_features
    elif is_conv1d(layer):
        width = layer.weight.shape[0]  # Conv1D weight: (in_features, out_features)
    elif with_embeddings and isinstance(layer, nn.Embedding) and layer.max_norm is None:
        width = layer.embedding_dim
    else:
        return False
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or type(weight.data) not in (torch.Tensor, nn.Parameter):
        return False  # none, or already quantized (a torchao tensor subclass)
    return weight.is_floating_point() and not (needs_group(mode) and width % group_size != 0)


def warn_mha_left_float(module: nn.Module, what: str, stacklevel: int = 2) -> list[str]:
    """Warn (``NoEffectWarning``) naming the ``nn.MultiheadAttention`` ``out_proj`` layers a transform leaves
    float; returns their names."""
    names = list(mha_out_projections(module))
    if names:
        warnings.warn(left_alone_message(names, what), NoEffectWarning, stacklevel=stacklevel + 1)
    return names


def quantizable_layers(
    module: nn.Module,
    mode: str | QuantizationConfig = "int8_dynamic",
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    skip_modules: Sequence[str] = (),
    group_size: int = GROUP_SIZE,
    embeddings: bool | None = None,
) -> list[str]:
    """Fully-qualified names of the layers ``mode`` would quantize.

    A layer is chosen when it is an ``nn.Linear`` (not the ``out_proj`` of an ``nn.MultiheadAttention``, see
    :mod:`lightning_lowmem.functional.multihead_attention`), a ``transformers`` ``Conv1D``, (with ``embeddings``)
    an ``nn.Embedding`` without ``max_norm`` or (int8 modes) an ``nn.Conv2d`` with a float weight, no entry of
    ``skip_modules`` names it or
    a parent (qualified name, dotted suffix, glob or class name), ``filter_fn(layer, fqn)`` is true, and for
    grouped int4 modes its input width is a multiple of ``group_size``. Layers sharing one weight (tied)
    are chosen together or not at all.

    Example::

        >>> model = nn.Sequential(nn.Embedding(10, 32), nn.Linear(32, 32), nn.Linear(32, 10))
        >>> model[2].weight = model[0].weight  # a tied output head
        >>> quantizable_layers(model), quantizable_layers(model, embeddings=False)
        (['0', '1', '2'], ['1'])
    """
    config = QuantizationConfig.of(mode, group_size)  # the checks of the mode and the group size
    mode, group_size = config.mode_name("quantizable_layers"), config.group_size
    if isinstance(skip_modules, str):
        raise TypeError(f"`skip_modules` must be a list of module names, got the string {skip_modules!r}.")
    with_embeddings = include_embeddings(mode, embeddings)
    unreachable = mha_out_projections(module)  # read as tensors by F.multi_head_attention_forward: stay float
    names = [
        fqn
        for fqn, layer in module.named_modules()
        if _eligible(layer, mode, with_embeddings, group_size)
        and fqn not in unreachable
        and not matches_any(fqn, layer, skip_modules)
        and (filter_fn is None or filter_fn(layer, fqn))
    ]
    chosen = set(names)
    for group in tied_groups(module):  # all members or none: the tie must survive
        if not set(group) <= chosen or any(is_conv1d(module.get_submodule(name)) for name in group):
            chosen -= set(group)
    return [name for name in names if name in chosen]


def quantize_(
    module: nn.Module,
    mode: str | QuantizationConfig,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    skip_modules: Sequence[str] = (),
    calibration_data: Iterable[Any] | None = None,
    example_inputs: tuple[Any, ...] | None = None,
    group_size: int = GROUP_SIZE,
    embeddings: bool | None = None,
    fallback: str | None = None,
) -> QuantizationReport:
    """Quantize the ``nn.Linear``, ``Conv1D`` and ``nn.Embedding`` layers of ``module`` in place (static
    mode: its Linear/Conv layers, into a new module).

    Args:
        module: the model.
        mode: a :class:`~lightning_lowmem.functional.config.QuantizationConfig` with a mode name, or its
            shorthand: one of :data:`MODES` (with ``group_size``), which builds one.
        filter_fn: ``filter_fn(layer, fqn) -> bool`` chooses layers. Default: ``None`` (every candidate).
        skip_modules: submodules kept in float (their children too): qualified names, dotted suffixes
            (``"lm_head"``), fnmatch globs (``"*.attn.*"``) or class names. Default: ``()``.
        calibration_data: ``"int8_static"`` only: an iterable of input tuples, keyword dicts
            (``model(**batch)``, e.g. Hugging Face batches) or single tensors, run through the prepared
            model to calibrate activation ranges. Default: ``None``.
        example_inputs: ``"int8_static"`` only: inputs used to export the model. Default: the first
            calibration batch.
        group_size: with a mode name, the group length of the int4 modes. Default: ``GROUP_SIZE`` (32).
        embeddings: quantize ``nn.Embedding`` tables too (weight-only, :func:`embedding_config`).
            Default: ``None``: yes for the in-place modes, no for ``"int8_static"`` (``True`` there
            raises).
        fallback: ``"int8_static"`` only: an in-place mode (e.g. ``"int8_weight_only"``) applied, with a
            ``LowMemWarning`` carrying the reason, when the model cannot be exported or torchao's quantizer
            cannot annotate it (:class:`~lightning_lowmem.functional.quantization.static.StaticQuantizationError`).
            Default: ``None`` (raise).

    Returns:
        A :class:`QuantizationReport` (``report.summary()`` says what was converted); ``report.module``
        is the quantized model (for ``"int8_static"`` a new exported ``GraphModule``, or a
        ``StaticInt8Module`` around it for models exported with ``use_cache=False``; ``module`` itself
        otherwise).

    Raises:
        ValueError: unknown ``mode``, a mode the device cannot run, bad ``group_size``, a ``skip_modules``
            entry naming nothing (the message lists the model's layers), missing calibration data for
            static mode or ``embeddings=True`` with it.
        TypeError: ``embeddings`` not a bool or ``None``.
        StaticQuantizationError: ``"int8_static"`` cannot export / annotate the model and no ``fallback``.

    Warns:
        NoEffectWarning: no layer matched; the module is returned unchanged.
        LowMemWarning: less than half of the parameter bytes were quantized (the message says which
            layer classes hold the rest).

    Example::

        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        >>> report = quantize_(model, "int8_weight_only")
        >>> report.converted, round(report.size_ratio, 1)
        (['0', '2'], 3.6)
    """
    config = QuantizationConfig.of(mode, group_size)  # the checks of the mode and the group size
    mode, group_size = config.mode_name("quantize_"), config.group_size
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be an nn.Module, got {type(module).__name__}.")
    include_embeddings(mode, embeddings)  # validates it
    if mode == "int8_static":
        from lightning_lowmem.functional.quantization.static import StaticQuantizationError, quantize_static

        if calibration_data is None:
            raise ValueError("mode='int8_static' needs `calibration_data` (an iterable of input batches).")
        check_patterns(module, skip_modules, "skip_modules")
        if fallback is not None:
            if fallback not in MODES or fallback == "int8_static":
                in_place = [m for m in MODES if m != "int8_static"]
                raise ValueError(f"`fallback`={fallback!r} must be an in-place mode, one of {in_place}.")
        batches = list(calibration_data)
        try:
            report = quantize_static(
                module, example_inputs or batches[0], batches, filter_fn=filter_fn, skip_modules=skip_modules
            )
        except StaticQuantizationError as error:
            if fallback is None:
                raise
            warnings.warn(f"{error} Falling back to mode={fallback!r} (`fallback`).", LowMemWarning, stacklevel=2)
            return quantize_(module, fallback, filter_fn=filter_fn, skip_modules=skip_modules, group_size=group_size)
        warn_if_mostly_float(module, report, stacklevel=3)
        return report
    device = next((p.device.type for p in module.parameters()), "cpu")
    reason = unsupported_reason(mode, device)
    if reason is not None:
        raise ValueError(f"`mode`={mode!r} cannot run on device {device!r}: {reason}")
    check_patterns(module, skip_modules, "skip_modules", quantizable_layers(module, mode, group_size=group_size))
    bytes_before = state_bytes(module)["parameters"]
    names = quantizable_layers(
        module, mode, filter_fn=filter_fn, skip_modules=skip_modules, group_size=group_size, embeddings=embeddings
    )
    warn_mha_left_float(module, f"quantize_(mode={mode!r})", stacklevel=2)
    if not names:
        warnings.warn(
            f"quantize_(mode={mode!r}) found no quantizable nn.Linear / Conv1D / nn.Embedding / nn.Conv2d layer in "
            f"{type(module).__name__} (after filter_fn / skip_modules): nothing was quantized.",
            NoEffectWarning,
            stacklevel=2,
        )
        return QuantizationReport(mode, bytes_before, bytes_before, [], module)
    if mode == "int4_weight_only":  # torchao's int4 (tinygemm) packs bf16 weights only; it asserts otherwise
        dtypes = sorted({str(module.get_submodule(name).weight.dtype) for name in names} - {"torch.bfloat16"})
        if dtypes:
            raise ValueError(
                f"`mode`='int4_weight_only' quantizes bfloat16 weights; {type(module).__name__} has {dtypes} weights. "
                "Convert first (model.to(torch.bfloat16), or train with precision='bf16-true'), or use "
                "mode='intx4_weight_only'."
            )
    converted_bytes = weight_bytes(module, names)
    conv1d, tied = _quantize_layers(module, mode, names, group_size=group_size)
    report = QuantizationReport(
        mode, bytes_before, state_bytes(module)["parameters"], names, module, conv1d, tied, converted_bytes
    )
    warn_if_mostly_float(module, report, stacklevel=3)
    return report


def _quantize_layers(
    module: nn.Module, mode: str, names: Sequence[str], *, group_size: int = GROUP_SIZE
) -> tuple[list[str], list[list[str]]]:
    """Quantize exactly ``names`` with ``mode`` (plus the rest of any tied group one of them is in).

    ``Conv1D`` layers are first replaced by exact ``nn.Linear`` layers; each tied group is quantized once
    with :func:`embedding_config` (a format both a lookup and a linear layer read) and the quantized
    weight is shared by its members again; other Linear layers get :func:`torchao_config`, Embedding
    tables :func:`embedding_config`, ``nn.Conv2d`` layers int8 per output channel
    (:func:`~lightning_lowmem.functional.quantization.conv.quantize_conv2d_`). Returns ``(Conv1D names
    converted, tied groups quantized)``.
    """
    chosen = set(names)
    conv1d = [name for name in names if is_conv1d(module.get_submodule(name))]
    if conv1d:
        convert_conv1d_(module, conv1d)
    groups = [group for group in tied_groups(module) if chosen & set(group)]
    in_groups = {name for group in groups for name in group}
    for group in groups:
        leader = module.get_submodule(group[0])
        apply_config(module, embedding_config(mode, group_size=group_size), group[:1], type(leader))
        for name in group[1:]:
            module.get_submodule(name).weight = leader.weight
    embeddings = [n for n in names if n not in in_groups and isinstance(module.get_submodule(n), nn.Embedding)]
    convs = [n for n in names if n not in in_groups and isinstance(module.get_submodule(n), nn.Conv2d)]
    linears = [n for n in names if n not in in_groups and n not in embeddings and n not in convs]
    if convs:
        quantize_conv2d_(module, convs)
    if linears:
        apply_config(module, torchao_config(mode, group_size=group_size), linears)
    if embeddings:
        apply_config(module, embedding_config(mode, group_size=group_size), embeddings, nn.Embedding)
    return conv1d, groups


def dequantize_(module: nn.Module) -> list[str]:
    """Replace every torchao-quantized ``nn.Linear`` / ``nn.Embedding`` / ``nn.Conv2d`` weight by its float
    dequantization, in place. Layers that shared a quantized weight share the float one.

    Returns:
        Names of the layers restored to float.
    """
    restored, floats = [], {}
    for fqn, layer in module.named_modules():
        weight = getattr(layer, "weight", None)
        quantizable = isinstance(layer, (nn.Linear, nn.Embedding, nn.Conv2d)) and weight is not None
        if quantizable and type(weight.data) is not torch.Tensor:
            if hasattr(weight, "dequantize"):
                if id(weight) not in floats:
                    floats[id(weight)] = nn.Parameter(weight.dequantize().to(torch.float32), requires_grad=True)
                layer.weight = floats[id(weight)]
                layer.__dict__.pop("extra_repr", None)  # torchao patches the instance's extra_repr
                restored.append(fqn)
    return restored


def quantized_copy(module: nn.Module, mode: str, names: Sequence[str], *, group_size: int = GROUP_SIZE) -> nn.Module:
    """A deep copy of ``module`` with exactly the layers ``names`` quantized (``module`` untouched)."""
    clone = copy.deepcopy(module)
    _quantize_layers(clone, mode, names, group_size=group_size)
    return clone


@contextmanager
def temporarily_quantized(
    module: nn.Module, mode: str, names: Sequence[str], *, group_size: int = GROUP_SIZE
) -> Iterator[nn.Module]:
    """``module`` with exactly ``names`` quantized inside the block; float again after it (the same layer
    objects and weight Parameters: Conv1D layers and ties come back as they were). What the accuracy search
    evaluates.

    Example::

        >>> model = nn.Sequential(nn.Linear(64, 64))
        >>> weight = model[0].weight
        >>> with temporarily_quantized(model, "int8_weight_only", ["0"]):
        ...     type(model[0].weight) is nn.Parameter
        False
        >>> model[0].weight is weight
        True
    """
    originals = {name: (module.get_submodule(name), module.get_submodule(name).weight) for name in names}
    _quantize_layers(module, mode, list(names), group_size=group_size)
    try:
        yield module
    finally:
        for name, (layer, weight) in originals.items():
            if module.get_submodule(name) is not layer:
                set_submodule(module, name, layer)  # the Conv1D an nn.Linear stood in for
            layer.weight = weight
            layer.__dict__.pop("extra_repr", None)  # torchao patches the instance's extra_repr
