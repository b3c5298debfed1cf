"""What each quantization mode is: its torchao configs, where it runs, and torchao storage details.

Used by :mod:`lightning_lowmem.functional.quantization.ptq` (which re-exports the public names), the QAT
and static modules and QLoRA's base quantization. Nothing here imports Lightning; torchao is imported
inside the functions that need it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from lightning_lowmem.functional.config.constants import GROUP_SIZE, QUANTIZATION_MODES
from lightning_lowmem.functional.quantization.serialization import keep_portable_

__all__ = [
    "MODES",
    "apply_config",
    "available_modes",
    "drop_zero_point",
    "drop_zero_points_",
    "embedding_config",
    "torchao_config",
]

MODES = QUANTIZATION_MODES  # the mode names and what each is (functional/config/constants.py)


def unsupported_reason(mode: str, device: str) -> str | None:
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
    return [mode for mode in MODES if unsupported_reason(mode, device) is None]


def _require_torchao() -> None:
    try:
        import torchao  # noqa: F401
    except ImportError as error:  # pragma: no cover - torchao is a dependency
        raise ImportError("Quantization needs torchao: `pip install torchao`.") from error
    from lightning_lowmem._versions import require

    require("torchao", "quantization")


def _not_in_place(mode: str) -> ValueError:
    return ValueError(
        f"`mode`={mode!r} has no torchao config: choose one of {[m for m in MODES if m != 'int8_static']} "
        "(int8_static goes through quantize_static; validate user input with QuantizationConfig(mode) first)"
    )


def torchao_config(mode: str, *, group_size: int = GROUP_SIZE) -> Any:
    """The torchao config object behind ``mode`` (not for ``"int8_static"``).

    ``mode`` and ``group_size`` are taken as validated: user input goes through
    :class:`~lightning_lowmem.functional.config.QuantizationConfig` (``QuantizationConfig(mode).torchao_config()``),
    the one place the mode and the group size are checked."""
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
    if mode == "intx4_weight_only":
        return tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    raise _not_in_place(mode)


def embedding_config(mode: str, *, group_size: int = GROUP_SIZE) -> Any:
    """The torchao config ``mode`` applies to ``nn.Embedding`` tables (weight-only: a lookup has no
    activations to quantize): int8 per row for the int8 modes, int4 values in groups of ``group_size``
    (stored one per int8 byte) for the int4 modes. Not for ``"int8_static"``; ``mode`` is taken as validated
    (see :func:`torchao_config`)."""
    if mode not in MODES or mode == "int8_static":
        raise _not_in_place(mode)
    _require_torchao()
    import torchao.quantization as tq
    from torchao.quantization.granularity import PerAxis, PerGroup

    if needs_group(mode):
        return tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    return tq.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def include_embeddings(mode: str, embeddings: bool | None) -> bool:
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


def needs_group(mode: str) -> bool:
    return mode in ("int4_weight_only", "intx4_weight_only")


def apply_config(module: nn.Module, config: Any, names: Sequence[str], layer_type: type = nn.Linear) -> None:
    """Apply the torchao ``config`` to exactly the layers ``names`` of type ``layer_type``; drop the
    all-zero zero points torchao leaves beside symmetric int8 weights (:func:`drop_zero_points_`); make the
    module's state dicts portable (:func:`~lightning_lowmem.functional.quantization.serialization.keep_portable_`)."""
    from torchao.quantization import quantize_ as torchao_quantize_

    chosen = set(names)
    torchao_quantize_(module, config, filter_fn=lambda layer, fqn: fqn in chosen and isinstance(layer, layer_type))
    drop_zero_points_(module, names)
    keep_portable_(module)  # its state dicts load under Lightning's callable map_location, whoever saves them


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
    from lightning_lowmem._compat.fake_mode import is_fake

    return tensor.device.type == "meta" or is_fake(tensor)
