"""QLoRA's storage side: quantizing the frozen base of a LoRA model with torchao (used by ``functional.lora``).

Kept apart from the adapter logic in ``lora.py``: these helpers decide which frozen weights are stored in which
torchao format, check the backend can run that format before anything is wrapped, and run a frozen quantized
linear so that backward keeps only the quantized weight (:func:`frozen_linear`).

Formats (``quantize_base``): ``"nf4"`` -- QLoRA's 4-bit NormalFloat on torchao's ``NF4Tensor`` (blocks of
:data:`NF4_BLOCK_SIZE` weights share one absmax scale; the scales are themselves quantized to int8 in blocks of
:data:`NF4_SCALER_BLOCK_SIZE`, QLoRA's double quantization; CPU and CUDA); ``"int8"`` -- torchao's int8
weight-only, one scale per row (CPU and CUDA); ``"int4"`` -- torchao's int4 tinygemm kernels (CUDA only).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Hashable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


def is_quantized(weight: torch.Tensor) -> bool:
    """A torchao quantized tensor subclass (it flattens into inner tensors; see :func:`dequantized`)."""
    return type(weight) not in (torch.Tensor, nn.Parameter) and hasattr(weight, "__tensor_flatten__")


NF4_BLOCK_SIZE = 64  # QLoRA's (and torchao's to_nf4's) weights per absmax scale
NF4_SCALER_BLOCK_SIZE = 256  # QLoRA's double quantization: scales per int8 block of scales (fewer: a smaller layer)
NF4_DEQUANTIZE_CHUNK = 1 << 16  # weights decoded at a time (a multiple of NF4_BLOCK_SIZE)
SLAB_ELEMENTS = 1 << 16  # weights a frozen quantized linear dequantizes at a time (256 KiB in float32)


FAKE_SHORTCUTS = True
"""Whether fake tensors (the estimator's) take two shortcuts that change no figure: NF4 weights laid out without the
quantization math (:func:`to_nf4_parameter`) and the slabs :func:`elide_repeated_slabs` skips. ``False``: the
estimate runs what a real step runs (the tests compare both)."""
_MEMORY_STATES: list[Callable[[], Hashable]] = []  # the estimators' probes, innermost last


@contextlib.contextmanager
def elide_repeated_slabs(memory_state: Callable[[], Hashable]) -> Iterator[None]:
    """Inside, on fake tensors: a slab loop (a frozen quantized linear dequantizing a slab at a time) skips the
    slabs that would only repeat what earlier slabs of their size did from the same ``memory_state()``.

    For the estimator, which runs a step on fake tensors to count its memory: a slab's ops allocate and free the
    same storages whatever its offset, so a slab of a given size, starting from a memory state an earlier slab of
    that size started from (``memory_state()``: whatever decides the figures, e.g. the live bytes per category and
    the caching allocator's free blocks), allocates and frees exactly as that one did and goes on to the same state;
    every peak it reaches was reached already. Skipping whole cycles of such slabs changes no figure (a fake tensor
    holds no values to write) and saves their ops: thousands a layer at 7B sizes. Real tensors run every slab.

    Example::

        >>> with elide_repeated_slabs(lambda: 0):  # on real tensors: no effect
        ...     pass
    """
    _MEMORY_STATES.append(memory_state)
    try:
        yield
    finally:
        _MEMORY_STATES.remove(memory_state)


def _each_slab(slabs: list[slice], body: Callable[[slice], None], tensor: torch.Tensor) -> None:
    """``body(slab)`` for each slab in turn, but those :func:`elide_repeated_slabs` skips (``tensor``: one of the
    loop's inputs; fake or not decides).

    The memory state is read before each slab; once it repeats within a run of slabs of one size (after one slab,
    or after a cycle of them: the allocator may place a slab's storages in turn in two places), the rest of the run
    would only go round that cycle again: whole cycles of it are skipped, the remainder runs.
    """
    from lightning_lowmem._compat.fake_mode import is_fake

    if not (FAKE_SHORTCUTS and _MEMORY_STATES and is_fake(tensor)):
        for slab in slabs:
            body(slab)
        return
    memory_state, index, seen = _MEMORY_STATES[-1], 0, {}
    while index < len(slabs):
        size = slabs[index].stop - slabs[index].start
        if index == 0 or size != slabs[index - 1].stop - slabs[index - 1].start:
            seen = {}  # a new run of slabs of one size
        state = memory_state()
        if state in seen:
            period, run = index - seen.pop(state), index
            while run < len(slabs) and slabs[run].stop - slabs[run].start == size:
                run += 1
            index += (run - index) // period * period  # whole cycles skipped: the same state at the end
            seen = {}
            if index == run:
                continue
        seen[state] = index
        body(slabs[index])
        index += 1


def is_nf4(weight: torch.Tensor) -> bool:
    """torchao's ``NF4Tensor`` (checked by name: torchao is imported only when a base is quantized)."""
    return type(weight).__name__ == "NF4Tensor"


def dequantized(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A plain float copy of a quantized ``weight`` (out, in), in ``dtype`` (default: the weight's).

    torchao's int4 tinygemm format (``Int4TilePackedTo4dTensor``) has no ``dequantize``; its own kernel
    gives it back: ``linear(I, W) = W^T``. ``NF4Tensor`` gives it back with ``get_original_weight``.
    """
    if is_nf4(weight):
        dense = _nf4_dense(weight)
    elif type(weight).dequantize is not torch.Tensor.dequantize:  # the format's own (torch's is for torch.ao qtensors)
        dense = weight.dequantize()
    else:
        eye = torch.eye(weight.shape[1], dtype=weight.dtype, device=weight.device)  # (in, in)
        dense = F.linear(eye, weight).t()  # (out, in)
    return dense if dtype is None else dense.to(dtype)


def _nf4_dense(weight: torch.Tensor, chunk: int = NF4_DEQUANTIZE_CHUNK) -> torch.Tensor:
    """``NF4Tensor.get_original_weight()`` (the same values), ``chunk`` elements at a time: torchao's decodes the
    whole tensor's 4-bit codes into int64 indices first (8 bytes per weight, 4x the bf16 result)."""
    numel, block = weight.numel(), weight.block_size
    scalers = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor, weight.scaler_block_size)
    dense = torch.empty(numel, dtype=weight.dtype, device=weight.device)  # (out * in,)
    packed = weight.quantized_data  # (out * in / 2,) two codes a byte, the first in the high half

    held: dict[str, torch.Tensor] = {}  # a part's codes and values, alive until the next part's replace them

    def decode(part: slice) -> None:  # part: whole blocks (chunk is a multiple of the block size)
        pairs = packed[part.start // 2 : part.stop // 2]
        held["codes"] = torch.stack([pairs >> 4, pairs & 0b1111], dim=-1).flatten().long()  # (chunk,)
        held["values"] = (
            weight.nf4[held["codes"]].view(-1, block) * scalers[part.start // block : part.stop // block, None]
        )
        dense[part] = held["values"].flatten()

    _each_slab([slice(start, min(start + chunk, numel)) for start in range(0, numel, chunk)], decode, packed)
    return dense.view(weight.shape)


def _in_slabs(weight: torch.Tensor) -> bool:
    """Whether :func:`_dense_slab` reads any rows / columns of ``weight`` from its inner tensors: NF4 with whole blocks
    per row, and torchao's int8 weight-only with one scale per row and no zero point."""
    if weight.dim() != 2:
        return False
    if is_nf4(weight):
        return weight.is_contiguous() and weight.shape[1] % weight.block_size == 0
    if type(weight).__name__ != "Int8Tensor" or getattr(weight, "zero_point", None) is not None:
        return False
    plain = getattr(weight, "act_quant_kwargs", None) is None and getattr(weight, "act_pre_scale", None) is None
    return plain and tuple(weight.block_size) == (1, weight.shape[1])


def _slabs(weight: torch.Tensor, dim: int) -> list[slice]:
    """Row (``dim=0``) or column (``dim=1``) ranges of about :data:`SLAB_ELEMENTS` weights (NF4 columns: whole blocks)."""
    size, other = weight.shape[dim], weight.shape[1 - dim]
    granule = weight.block_size if is_nf4(weight) and dim == 1 else 1
    step = max(granule, SLAB_ELEMENTS // max(other, 1) // granule * granule)
    return [slice(start, min(start + step, size)) for start in range(0, size, step)]


def _dense_slab(weight: torch.Tensor, rows: slice, cols: slice, dtype: torch.dtype, scalers: Any) -> torch.Tensor:
    """``dequantized(weight)[rows, cols]`` in ``dtype`` (the same values), decoding only that slab."""
    out_features, in_features = weight.shape
    if is_nf4(weight):
        block = weight.block_size
        packed = weight.quantized_data.view(out_features, in_features // 2)[rows, cols.start // 2 : cols.stop // 2]
        codes = torch.stack([packed >> 4, packed & 0b1111], dim=-1).flatten().int()  # (r * c,)
        values = weight.nf4.index_select(0, codes).view(packed.shape[0], -1, block)  # (r, c / block, block)
        scales = scalers.view(out_features, in_features // block)[rows, cols.start // block : cols.stop // block]
        return (values * scales[..., None]).flatten(1).to(dtype)
    scale = weight.scale.reshape(out_features, 1)[rows]  # int8: one scale per row, as torchao's dequantize_affine
    return (weight.qdata[rows, cols].to(weight.dtype) * scale).to(weight.dtype).to(dtype)


def _scalers(weight: torch.Tensor) -> Any:
    """NF4's per-block scales, decoded once per call (one per 64 weights); ``None`` for other formats."""
    if not is_nf4(weight):
        return None
    return weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor, weight.scaler_block_size)


def _linear_in_slabs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, dequantized(weight), bias)``, the output features a slab of dequantized rows at a time."""
    scalers, every_column = _scalers(weight), slice(0, weight.shape[1])
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))  # (..., out)

    held: dict[str, torch.Tensor] = {}  # a slab stays alive until the next one replaces it

    def rows_out(rows: slice) -> None:
        held["slab"] = _dense_slab(weight, rows, every_column, x.dtype, scalers)  # (r, in)
        out[..., rows] = F.linear(x, held["slab"], None if bias is None else bias[rows])

    _each_slab(_slabs(weight, 0), rows_out, x)
    return out


def _input_grad_in_slabs(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad_out @ dequantized(weight)``, the input features a slab of dequantized columns at a time."""
    scalers, every_row = _scalers(weight), slice(0, weight.shape[0])
    grad_x = grad_out.new_empty((*grad_out.shape[:-1], weight.shape[1]))  # (..., in)

    def cols_in(cols: slice) -> None:
        grad_x[..., cols] = grad_out.matmul(_dense_slab(weight, every_row, cols, grad_out.dtype, scalers))

    _each_slab(_slabs(weight, 1), cols_in, grad_out)
    return grad_x


def _nf4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with an NF4 ``weight``, in slabs of dequantized rows where the blocks allow."""
    if _in_slabs(weight):
        return _linear_in_slabs(x, weight, bias)
    return F.linear(x, dequantized(weight, x.dtype), bias)


class _FrozenQuantizedLinear(torch.autograd.Function):
    """``F.linear`` with a frozen quantized weight. torchao's kernels need not be differentiable (int4
    tinygemm's ``_weight_int4pack_mm`` is not) and int8 weight-only saves a float copy of the weight for
    backward; here only the quantized weight is saved, and backward computes the input's gradient from it,
    dequantizing a slab of :data:`SLAB_ELEMENTS` weights at a time (NF4, int8; other formats: the whole weight,
    transiently, one layer at a time). Nothing weight-sized is kept from forward to backward. Forward is
    torchao's kernel, but for NF4 (whose torchao linear decodes through int64 indices): slabs of rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)  # a parameter: compression / offload hooks keep it as it is
        ctx.x_dtype = x.dtype
        if is_nf4(weight):  # torchao's NF4 linear decodes the whole weight through int64 indices
            return _nf4_linear(x, weight, bias)
        return F.linear(x, weight, bias)  # torchao's kernel: the same numbers as the model without adapters

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        (weight,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            if _in_slabs(weight):
                grad_x = _input_grad_in_slabs(grad_out, weight).to(ctx.x_dtype)  # (..., in)
            else:
                grad_x = grad_out.matmul(dequantized(weight, grad_out.dtype)).to(ctx.x_dtype)  # (..., in)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, grad_bias


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; for a quantized ``weight`` whose input needs a gradient, through
    :class:`_FrozenQuantizedLinear` (QLoRA's frozen base)."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    if is_nf4(weight) and not needs_grad:
        return _nf4_linear(x, weight, bias)
    if not needs_grad or not is_quantized(weight) or weight.requires_grad:
        return F.linear(x, weight, bias)
    return _FrozenQuantizedLinear.apply(x, weight, bias)


class KeepsQuantizedWeight:
    """A mixin for layers whose frozen ``weight`` may be quantized: ``module.to(dtype)`` / ``.half()`` leave a
    quantized weight's format and compute dtype alone (it was quantized in the dtype it trains in) and only move
    it between devices. Lightning's precision plugins convert the whole model with ``module.to(dtype=...)``
    after the callbacks' ``setup``; torchao's ``NF4Tensor.to(dtype)`` returns a *dequantized* plain tensor, which
    would silently undo QLoRA.

    Overrides ``nn.Module._apply``, the one method every ``to`` / ``half`` / ``cuda`` / ``cpu`` goes through
    (``torch.nn.Module`` documents no public hook for it): the other parameters and buffers go through it
    unchanged.
    """

    weight: torch.Tensor | None

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        weight = getattr(self, "weight", None)
        if not isinstance(weight, torch.Tensor) or not type(weight).__module__.startswith("torchao."):
            return super()._apply(fn, recurse)  # type: ignore[misc]  (plain, or FSDP2's DTensor shards)
        self.weight = None  # a registered parameter set to None: _apply skips it
        try:
            super()._apply(fn, recurse)  # type: ignore[misc]
        finally:
            self.weight = weight  # type: ignore[assignment]
        target = fn(torch.empty(0, dtype=weight.dtype, device=weight.device))  # where fn sends a tensor
        if target.device != weight.device:
            self.weight = nn.Parameter(weight.to(target.device), requires_grad=False)
        return self


class FrozenQuantizedLinear(KeepsQuantizedWeight, nn.Linear):
    """A frozen ``nn.Linear`` whose weight ``quantize_frozen`` quantized: the same ``weight`` / ``bias`` names
    and state dict, a forward through :func:`frozen_linear` (backward keeps only the quantized weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight, self.bias)


def nf4_blocks(numel: int) -> tuple[int, int] | None:
    """``(block_size, scaler_block_size)`` for an NF4 tensor of ``numel`` elements: QLoRA's 64 and 256, the scaler
    blocks halved until they divide the number of blocks; ``None`` when ``numel`` is not a multiple of 64.

    Example::

        >>> nf4_blocks(1024 * 1024), nf4_blocks(64 * 64), nf4_blocks(100 * 30)
        ((64, 256), (64, 64), None)
    """
    if numel % NF4_BLOCK_SIZE:
        return None
    blocks, scaler_block = numel // NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE
    while blocks % scaler_block:
        scaler_block //= 2
    return NF4_BLOCK_SIZE, scaler_block


def to_nf4_parameter(weight: torch.Tensor) -> nn.Parameter:
    """``weight`` as a frozen torchao ``NF4Tensor`` parameter (same dtype: the compute dtype of its linear)."""
    from torchao.quantization import to_nf4

    blocks = nf4_blocks(weight.numel())
    if blocks is None:
        raise ValueError(
            f"`quantize_base`='nf4' needs weights whose size is a multiple of {NF4_BLOCK_SIZE} (its block size); "
            f"a weight has shape {tuple(weight.shape)}. Hint: target other layers, or use quantize_base='int8'."
        )
    from lightning_lowmem._compat.fake_mode import is_fake

    if FAKE_SHORTCUTS and is_fake(weight):  # the estimator's: no values to quantize, only the layout to count
        return nn.Parameter(_nf4_layout(weight.detach(), *blocks), requires_grad=False)
    return nn.Parameter(to_nf4(weight.detach(), *blocks), requires_grad=False)


def _nf4_layout(weight: torch.Tensor, block_size: int, scaler_block_size: int) -> torch.Tensor:
    """The ``NF4Tensor`` ``to_nf4(weight, block_size, scaler_block_size)`` returns, with its inner tensors empty:
    the same shapes, dtypes and storages (one each), without the quantization math (thousands of ops on a fake 8B
    layer). ``tests/planning/test_estimate_qlora_elided.py`` checks it against ``to_nf4``."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

    blocks = weight.numel() // block_size
    meta = SubclassTensorArgs(
        weight.size(), weight.stride(), weight.storage_offset(), weight.dtype, weight.device, weight.requires_grad
    )
    return NF4Tensor(
        meta,
        block_size,
        blocks,
        scaler_block_size,
        weight.new_empty(blocks, dtype=torch.int8),  # quantized_scalers: one int8 scale per block
        weight.new_empty(blocks // scaler_block_size),  # quantization_factor: one per block of scales
        weight.new_empty(()),  # scaler_mean
        weight.new_empty(weight.numel() // 2, dtype=torch.uint8),  # quantized_data: two 4-bit codes a byte
        weight.new_empty(16),  # nf4: the 16 NormalFloat values
    )


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


def _quantize_linear_(module: nn.Module, name: str, layer: nn.Linear, quantize_base: str) -> None:
    """Quantize the weight of ``layer`` (``module``'s submodule ``name``) in place, frozen."""
    if quantize_base == "nf4":
        layer.weight = to_nf4_parameter(layer.weight)
        return
    from torchao.quantization import quantize_

    from lightning_lowmem.functional.quantization.modes import drop_zero_point

    config = torchao_config(quantize_base, layer.in_features)  # per layer: int4's group size depends on in_features
    _bf16_for_int4(layer, quantize_base)
    quantize_(module, config, filter_fn=lambda sub, fqn: fqn == name and sub is layer)
    drop_zero_point(layer.weight)  # int8: torchao's all-zero symmetric zero points, one byte per row
    layer.weight.requires_grad_(False)


def quantize_base_layers_(module: nn.Module, layers: dict[str, nn.Linear], quantize_base: str) -> None:
    """Quantize the base weights of ``layers`` (qualified name -> adapter layer of ``module``), frozen."""
    for name, layer in layers.items():
        _quantize_linear_(module, name, layer, quantize_base)


def check_quantization_supported(quantize_base: str, example: nn.Module) -> None:
    """Quantize a small probe layer like ``example`` first, so an unsupported backend wraps nothing."""
    weight = example.weight
    if quantize_base == "int4" and weight.device.type != "cuda":
        raise RuntimeError(
            f"`quantize_base`='int4' runs on CUDA only (torchao's int4 tinygemm kernels); the model is on "
            f"{weight.device.type!r}. Nothing was wrapped. Hint: quantize_base='nf4' (QLoRA's 4-bit NormalFloat) "
            f"trains and estimates on CPU and CUDA."
        )
    in_features = 256
    probe = nn.Sequential(nn.Linear(in_features, 64, device=weight.device, dtype=weight.dtype))
    probe.requires_grad_(False)
    try:
        _quantize_linear_(probe, "0", probe[0], quantize_base)
        probe(torch.zeros(1, in_features, device=weight.device, dtype=weight.dtype))
    except Exception as err:
        import torchao

        raise RuntimeError(
            f"`quantize_base`={quantize_base!r} is not supported by torchao {torchao.__version__} for "
            f"{weight.dtype} weights on device {weight.device.type!r}: {type(err).__name__}: {err}. "
            f"Nothing was wrapped. Hint: use quantize_base='nf4' or 'int8' (both work on CPU and CUDA)."
        ) from err


def _frozen_format(sub: nn.Module, quantize_base: str) -> str | None:
    """How :func:`quantize_frozen_` stores ``sub``'s weight: ``"linear"``, ``"embedding"`` or ``None`` (kept)."""
    if type(sub) is nn.Linear:
        fits = {"int8": True, "int4": sub.in_features % 32 == 0, "nf4": nf4_blocks(sub.weight.numel()) is not None}
        return "linear" if fits[quantize_base] else None
    if type(sub) is nn.Embedding and sub.max_norm is None:
        from lightning_lowmem.functional.quantization.modes import GROUP_SIZE

        # 4-bit tables are grouped along the row (T5's 8-wide relative-position table stays float)
        return "embedding" if quantize_base == "int8" or sub.embedding_dim % GROUP_SIZE == 0 else None
    return None


def quantize_frozen_(module: nn.Module, quantize_base: str, adapter_type: type[nn.Module]) -> list[str]:
    """Quantize the frozen, unshared weights of plain linear layers and embedding tables (not adapters).

    Linear layers become :class:`FrozenQuantizedLinear` (their forward keeps only the quantized weight for
    backward); embedding tables take torchao's int8 (``"int8"``) or 4-bit (``"int4"`` / ``"nf4"``) weight-only
    embedding format (a lookup needs no weight in backward).
    """
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
        kind = _frozen_format(sub, quantize_base)
        if kind == "linear":
            _quantize_linear_(module, name, sub, quantize_base)
            sub.__class__ = FrozenQuantizedLinear  # same state, a forward through frozen_linear
        elif kind == "embedding":
            config = embedding_config("int8_weight_only" if quantize_base == "int8" else "intx4_weight_only")
            quantize_(module, config, filter_fn=lambda m, fqn, name=name: fqn == name)
            sub.weight.requires_grad_(False)
        else:
            continue
        done.append(name)
    return done
