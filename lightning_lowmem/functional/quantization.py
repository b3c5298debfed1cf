"""Post-training and quantization-aware quantization of ``nn.Linear`` (and ``nn.Embedding``) layers on torchao.

Every mode is a torchao config applied with ``torchao.quantization.quantize_`` (weights are swapped
in place for torchao tensor subclasses); static int8 goes through ``torchao.quantization.pt2e`` and
lives in :mod:`lightning_lowmem.functional.quantization_static`. Nothing here imports Lightning.

Embedding tables (``nn.Embedding``) take indices, not activations, so every in-place mode quantizes
them weight-only with torchao's ``IntxWeightOnlyConfig`` (see :func:`embedding_config`): int8 per row
for the int8 modes, int4 values in groups of ``group_size`` for the int4 modes. They are included by
default (``embeddings=None``); ``int8_static`` leaves them float. QAT covers ``nn.Linear`` only.

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
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from lightning_lowmem.functional.quantization_search import (  # re-exported: part of this module's API
    ToleranceSearchResult,
    measure_latency,
    search_float_fallback,
)
from lightning_lowmem.memory.measure import state_bytes
from lightning_lowmem.warnings import NoEffectWarning

__all__ = [
    "MODES",
    "QAT_MODES",
    "QuantizationReport",
    "ToleranceSearchResult",
    "available_modes",
    "convert_qat_",
    "dequantize_",
    "drop_zero_point",
    "drop_zero_points_",
    "embedding_config",
    "measure_latency",
    "prepare_qat_",
    "quantizable_layers",
    "quantize_",
    "search_float_fallback",
    "set_fake_quant_enabled",
]

MODES: dict[str, str] = {
    "int8_dynamic": "int8 weights + int8 dynamic activations (torchao Int8DynamicActivationInt8WeightConfig)",
    "int8_weight_only": "int8 weights, float activations (torchao Int8WeightOnlyConfig)",
    "int4_weight_only": "packed int4 weights, bf16 activations (torchao Int4WeightOnlyConfig; CUDA only)",
    "intx4_weight_only": "int4 values stored in int8 bytes (torchao IntxWeightOnlyConfig; any device)",
    "int8_static": "int8 weights + calibrated static int8 activations (torchao pt2e, X86InductorQuantizer)",
}
#: modes QAT can train for (torchao QATConfig infers the fake quantizers from these base configs).
QAT_MODES: tuple[str, ...] = ("int8_weight_only", "int4_weight_only", "intx4_weight_only")


@dataclass
class QuantizationReport:
    """What a quantization call did.

    Attributes:
        mode: the mode applied.
        bytes_before: parameter + buffer bytes of the module before.
        bytes_after: the same after (torchao tensors counted by their inner int data and scales).
        converted: fully-qualified names of the layers (Linear and Embedding) that were quantized.
        module: the quantized module (the same object for in-place modes; a new exported module
            for ``"int8_static"``).
    """

    mode: str
    bytes_before: int
    bytes_after: int
    converted: list[str] = field(default_factory=list)
    module: nn.Module | None = field(default=None, repr=False)

    @property
    def size_ratio(self) -> float:
        """``bytes_before / bytes_after`` (``1.0`` when nothing changed)."""
        return self.bytes_before / self.bytes_after if self.bytes_after else float("nan")


def _check_mode(mode: str, allowed: Iterable[str] = MODES) -> None:
    allowed = tuple(allowed)
    if not isinstance(mode, str) or mode not in allowed:
        raise ValueError(f"`mode`={mode!r} is not a known quantization mode; choose one of {list(allowed)}.")


def _unsupported_reason(mode: str, device: str) -> str | None:
    """Why ``mode`` cannot run on ``device`` with the installed torchao, or ``None`` if it can."""
    if mode == "int4_weight_only" and device != "cuda":
        return (
            "torchao 0.18's Int4WeightOnlyConfig has no CPU kernel: its 'plain'/'preshuffled' packing "
            "formats need the `mslk` package, 'plain_int32' rejects CPU tensors and 'tile_packed_to_4d' "
            "needs CUDA + bf16. Use mode='intx4_weight_only' on CPU (int4 values, int8 storage)."
        )
    if mode == "int4_weight_only" and not torch.cuda.is_available():
        return "mode='int4_weight_only' needs a CUDA device and none is available."
    if mode == "int8_static":
        try:
            from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer  # noqa: F401
        except ImportError as error:  # pragma: no cover - depends on the torchao build
            return f"torchao.quantization.pt2e is not importable ({error})."
    return None


def available_modes(device: str = "cpu") -> list[str]:
    """Quantization modes that run on ``device`` with the installed torch / torchao.

    Args:
        device: ``"cpu"`` or ``"cuda"``. Default: ``"cpu"``.

    Returns:
        The mode names, a subset of :data:`MODES`.

    Example::

        >>> "int8_dynamic" in available_modes("cpu"), "int4_weight_only" in available_modes("cpu")
        (True, False)
    """
    return [mode for mode in MODES if _unsupported_reason(mode, device) is None]


def _require_torchao() -> None:
    try:
        import torchao  # noqa: F401
    except ImportError as error:  # pragma: no cover - torchao is a dependency
        raise ImportError("Quantization needs torchao: `pip install torchao`.") from error


def torchao_config(mode: str, *, group_size: int = 32) -> Any:
    """The torchao config object behind ``mode`` (not for ``"int8_static"``)."""
    _check_mode(mode, [m for m in MODES if m != "int8_static"])
    _require_torchao()
    import torchao.quantization as tq
    from torchao.quantization.granularity import PerGroup

    if mode == "int8_dynamic":
        return tq.Int8DynamicActivationInt8WeightConfig()
    if mode == "int8_weight_only":
        return tq.Int8WeightOnlyConfig()
    if mode == "int4_weight_only":
        from torchao.quantization.quantize_.workflows.int4.int4_packing_format import Int4PackingFormat

        return tq.Int4WeightOnlyConfig(group_size=group_size, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D)
    return tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))


def embedding_config(mode: str, *, group_size: int = 32) -> Any:
    """The torchao config ``mode`` applies to ``nn.Embedding`` tables (weight-only: a lookup has no
    activations to quantize): int8 per row for the int8 modes, int4 values in groups of ``group_size``
    (stored one per int8 byte) for the int4 modes. Not for ``"int8_static"``."""
    _check_mode(mode, [m for m in MODES if m != "int8_static"])
    _require_torchao()
    import torchao.quantization as tq
    from torchao.quantization.granularity import PerAxis, PerGroup

    if _needs_group(mode):
        return tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    return tq.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def _include_embeddings(mode: str, embeddings: bool | None) -> bool:
    """Resolve ``embeddings`` (``None``: every in-place mode yes, ``int8_static`` no)."""
    if embeddings is not None and not isinstance(embeddings, bool):
        raise TypeError(f"`embeddings` must be True, False or None (the mode's default), got {embeddings!r}.")
    if mode == "int8_static":
        if embeddings:
            raise ValueError(
                "`embeddings`=True is not supported with mode='int8_static': pt2e's X86InductorQuantizer leaves "
                "nn.Embedding float. Use an in-place mode (e.g. 'int8_weight_only') or embeddings=None/False."
            )
        return False
    return embeddings is None or embeddings


def _qat_base_config(mode: str, group_size: int) -> Any:
    """Base config QAT trains for; int8 weight-only QAT goes through torchao's Intx config (QATConfig
    does not take Int8WeightOnlyConfig)."""
    if mode == "int8_weight_only":
        import torchao.quantization as tq

        return tq.IntxWeightOnlyConfig(weight_dtype=torch.int8)
    return torchao_config(mode, group_size=group_size)


def _needs_group(mode: str) -> bool:
    return mode in ("int4_weight_only", "intx4_weight_only")


def quantizable_layers(
    module: nn.Module,
    mode: str = "int8_dynamic",
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    skip_modules: Sequence[str] = (),
    group_size: int = 32,
    embeddings: bool | None = None,
) -> list[str]:
    """Fully-qualified names of the ``nn.Linear`` (and ``nn.Embedding``) layers ``mode`` would quantize.

    A layer is chosen when it is an ``nn.Linear`` (or, with ``embeddings``, an ``nn.Embedding`` without
    ``max_norm``, which renormalizes the table in place) with a float weight, its name is not in
    ``skip_modules`` (nor below one of them), ``filter_fn(layer, fqn)`` is true, and for grouped int4
    modes its ``in_features`` / ``embedding_dim`` is a multiple of ``group_size``.
    """
    _check_mode(mode)
    if isinstance(skip_modules, str):
        raise TypeError(f"`skip_modules` must be a list of module names, got the string {skip_modules!r}.")
    with_embeddings = _include_embeddings(mode, embeddings)
    skip = tuple(skip_modules)
    names = []
    for fqn, layer in module.named_modules():
        if isinstance(layer, nn.Linear):
            width = layer.in_features
        elif with_embeddings and isinstance(layer, nn.Embedding) and layer.max_norm is None:
            width = layer.embedding_dim
        else:
            continue
        if not isinstance(getattr(layer, "weight", None), torch.Tensor):
            continue
        if type(layer.weight.data) not in (torch.Tensor, nn.Parameter) or not layer.weight.is_floating_point():
            continue  # already quantized (a torchao tensor subclass)
        if any(fqn == s or fqn.startswith(s + ".") for s in skip):
            continue
        if filter_fn is not None and not filter_fn(layer, fqn):
            continue
        if _needs_group(mode) and width % group_size != 0:
            continue
        names.append(fqn)
    return names


def quantize_(
    module: nn.Module,
    mode: str,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    skip_modules: Sequence[str] = (),
    calibration_data: Iterable[Any] | None = None,
    example_inputs: tuple[Any, ...] | None = None,
    group_size: int = 32,
    embeddings: bool | None = None,
) -> QuantizationReport:
    """Quantize the ``nn.Linear`` and ``nn.Embedding`` layers of ``module`` in place (static mode: its
    Linear/Conv layers, into a new module).

    Args:
        module: the model.
        mode: one of :data:`MODES`.
        filter_fn: ``filter_fn(layer, fqn) -> bool`` chooses layers. Default: ``None`` (every candidate).
        skip_modules: names of submodules kept in float (their children too). Default: ``()``.
        calibration_data: ``"int8_static"`` only: an iterable of input tuples (or single tensors)
            run through the prepared model to calibrate activation ranges. Default: ``None``.
        example_inputs: ``"int8_static"`` only: inputs used to export the model. Default: the first
            calibration batch.
        group_size: group length of the int4 modes. Default: ``32``.
        embeddings: quantize ``nn.Embedding`` tables too (weight-only, :func:`embedding_config`).
            Default: ``None``: yes for the in-place modes, no for ``"int8_static"`` (``True`` there
            raises).

    Returns:
        A :class:`QuantizationReport`; ``report.module`` is the quantized model (a new exported
        ``GraphModule`` for ``"int8_static"``, ``module`` itself otherwise).

    Raises:
        ValueError: unknown ``mode``, a mode the device cannot run, bad ``group_size``, missing
            calibration data for static mode or ``embeddings=True`` with it.
        TypeError: ``embeddings`` not a bool or ``None``.

    Warns:
        NoEffectWarning: no layer matched; the module is returned unchanged.

    Example::

        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        >>> report = quantize_(model, "int8_weight_only")
        >>> report.converted, round(report.size_ratio, 1)
        (['0', '2'], 3.6)
    """
    _check_mode(mode)
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be an nn.Module, got {type(module).__name__}.")
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"`group_size` must be a positive int, got {group_size!r}.")
    _include_embeddings(mode, embeddings)  # validates it
    if mode == "int8_static":
        from lightning_lowmem.functional.quantization_static import quantize_static

        if calibration_data is None:
            raise ValueError("mode='int8_static' needs `calibration_data` (an iterable of input batches).")
        batches = list(calibration_data)
        return quantize_static(
            module, example_inputs or _as_args(batches[0]), batches, filter_fn=filter_fn, skip_modules=skip_modules
        )
    device = next((p.device.type for p in module.parameters()), "cpu")
    reason = _unsupported_reason(mode, device)
    if reason is not None:
        raise ValueError(f"`mode`={mode!r} cannot run on device {device!r}: {reason}")
    bytes_before = state_bytes(module)["parameters"]
    names = quantizable_layers(
        module, mode, filter_fn=filter_fn, skip_modules=skip_modules, group_size=group_size, embeddings=embeddings
    )
    if not names:
        warnings.warn(
            f"quantize_(mode={mode!r}) found no quantizable nn.Linear / nn.Embedding layer in {type(module).__name__} "
            "(after filter_fn / skip_modules): nothing was quantized.",
            NoEffectWarning,
            stacklevel=2,
        )
        return QuantizationReport(mode, bytes_before, bytes_before, [], module)
    _quantize_layers(module, mode, names, group_size=group_size)
    return QuantizationReport(mode, bytes_before, state_bytes(module)["parameters"], names, module)


def _apply_config(module: nn.Module, config: Any, names: Sequence[str], layer_type: type = nn.Linear) -> None:
    from torchao.quantization import quantize_ as torchao_quantize_

    chosen = set(names)
    torchao_quantize_(module, config, filter_fn=lambda layer, fqn: fqn in chosen and isinstance(layer, layer_type))
    drop_zero_points_(module, names)


def drop_zero_points_(module: nn.Module, names: Sequence[str] | None = None) -> int:
    """Drop the all-zero zero points torchao stores beside symmetric int8 weights, in place.

    torchao's ``Int8Tensor`` (``int8_dynamic`` / ``int8_weight_only``) keeps an int8 zero point per row
    even for symmetric quantization, where every one is 0; its own kernels never read it and its
    ``dequantize`` treats ``None`` as 0, so dropping it changes no output and saves one byte per row
    (1/128 of an int8 layer at width 128). Only weights whose zero points are all 0 are touched; torchao
    tensors whose zero point is not optional (``IntxUnpackedToInt8Tensor``) are left alone.

    Args:
        module: the quantized model.
        names: layers to look at. Default: ``None`` (every submodule).

    Returns:
        Bytes freed.

    Example::

        >>> model = nn.Sequential(nn.Linear(128, 64))
        >>> from torchao.quantization import Int8WeightOnlyConfig, quantize_ as torchao_quantize_
        >>> torchao_quantize_(model, Int8WeightOnlyConfig())
        >>> drop_zero_points_(model)
        64
    """
    layers = module.named_modules() if names is None else ((name, module.get_submodule(name)) for name in names)
    return sum(drop_zero_point(getattr(layer, "weight", None)) for _, layer in layers)


def drop_zero_point(tensor: Any) -> int:
    """:func:`drop_zero_points_` for one tensor (anything else passes untouched). Returns bytes freed.

    Also used on incoming state dicts, so a checkpoint written with torchao's zero points loads into a
    model quantized here. Fake and meta tensors (memory estimates) have no values to check: their zero
    points are dropped, as a real run's from the same symmetric config would be."""
    zero_point = getattr(tensor, "zero_point", None)
    if zero_point is None or "zero_point" not in getattr(type(tensor), "optional_tensor_data_names", ()):
        return 0
    if not _values_unknown(zero_point) and bool(zero_point.any()):
        return 0
    tensor.zero_point = None
    return zero_point.untyped_storage().nbytes()


def _values_unknown(tensor: torch.Tensor) -> bool:
    """A fake or meta tensor (a memory estimate): its zero points come from the same symmetric
    config as a real run's, which are all 0."""
    from torch._subclasses.fake_tensor import is_fake

    return tensor.device.type == "meta" or is_fake(tensor)


def _quantize_layers(module: nn.Module, mode: str, names: Sequence[str], *, group_size: int = 32) -> None:
    """Quantize exactly ``names`` with ``mode``: Linear layers with :func:`torchao_config`, Embedding
    tables with :func:`embedding_config`."""
    embeddings = [name for name in names if isinstance(module.get_submodule(name), nn.Embedding)]
    linears = [name for name in names if name not in embeddings]
    if linears:
        _apply_config(module, torchao_config(mode, group_size=group_size), linears)
    if embeddings:
        _apply_config(module, embedding_config(mode, group_size=group_size), embeddings, nn.Embedding)


def _as_args(batch: Any) -> tuple[Any, ...]:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def dequantize_(module: nn.Module) -> list[str]:
    """Replace every torchao-quantized ``nn.Linear`` / ``nn.Embedding`` weight by its float
    dequantization, in place.

    Returns:
        Names of the layers restored to float.
    """
    restored = []
    for fqn, layer in module.named_modules():
        weight = getattr(layer, "weight", None)
        if isinstance(layer, (nn.Linear, nn.Embedding)) and weight is not None and type(weight.data) is not torch.Tensor:
            if hasattr(weight, "dequantize"):
                layer.weight = nn.Parameter(weight.dequantize().to(torch.float32), requires_grad=True)
                layer.__dict__.pop("extra_repr", None)  # torchao patches the instance's extra_repr
                restored.append(fqn)
    return restored


# --- quantization-aware training -------------------------------------------------------------------


def prepare_qat_(
    module: nn.Module,
    mode: str,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    skip_modules: Sequence[str] = (),
    group_size: int = 32,
) -> list[str]:
    """Swap the chosen ``nn.Linear`` layers for torchao fake-quantized ones (``QATConfig`` prepare).

    Weights stay the same ``nn.Parameter`` objects, so an optimizer created before still updates
    them. Returns the names of the layers prepared.
    """
    _check_mode(mode, QAT_MODES)
    device = next((p.device.type for p in module.parameters()), "cpu")
    reason = _unsupported_reason(mode, device)
    if reason is not None:
        raise ValueError(f"`mode`={mode!r} cannot run on device {device!r}: {reason}")
    from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

    names = [
        fqn
        for fqn in quantizable_layers(
            module, mode, filter_fn=filter_fn, skip_modules=skip_modules, group_size=group_size, embeddings=False
        )
        if not isinstance(module.get_submodule(fqn), FakeQuantizedLinear)
    ]
    if names:
        _apply_config(module, QATConfig(_qat_base_config(mode, group_size), step="prepare"), names)
    return names


def set_fake_quant_enabled(module: nn.Module, enabled: bool) -> int:
    """Turn torchao fake quantizers on/off (a disabled one returns its input). Returns how many."""
    from torchao.quantization.qat import FakeQuantizerBase

    count = 0
    for child in module.modules():
        if isinstance(child, FakeQuantizerBase):
            child.enabled = enabled
            count += 1
    return count


def convert_qat_(module: nn.Module, mode: str, *, group_size: int = 32) -> QuantizationReport:
    """Swap fake-quantized layers back to ``nn.Linear`` and quantize them for real (``QATConfig``
    convert). Returns a :class:`QuantizationReport` of the converted layers."""
    _check_mode(mode, QAT_MODES)
    from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

    names = [fqn for fqn, layer in module.named_modules() if isinstance(layer, FakeQuantizedLinear)]
    bytes_before = state_bytes(module)["parameters"]
    if names:
        _apply_config(module, QATConfig(_qat_base_config(mode, group_size), step="convert"), names)
    return QuantizationReport(mode, bytes_before, state_bytes(module)["parameters"], names, module)


def quantized_copy(module: nn.Module, mode: str, names: Sequence[str], *, group_size: int = 32) -> nn.Module:
    """A deep copy of ``module`` with exactly the layers ``names`` quantized (``module`` untouched)."""
    clone = copy.deepcopy(module)
    _quantize_layers(clone, mode, names, group_size=group_size)
    return clone
