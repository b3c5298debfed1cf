"""Attention in the fake step: the kernel the real step runs, and the memory that kernel keeps.

Two things make a fake step's attention differ from the real one, and this module corrects both:

* **The mask.** ``transformers`` skips building the (B, 1, T, T) attention mask when the batch has no
  padding (SDPA then runs ``is_causal=True`` and the fused kernel keeps no T x T tensor). It decides from
  the mask's *values*, which a fake tensor has none of, so on fake tensors it always builds the mask and
  SDPA saves it for backward: +60% at 2k tokens, +127% at 4k on a small Llama. The estimator reads the
  real batch's masks before faking them (:func:`batch_is_padded`) and, for an unpadded batch, lets
  ``transformers`` decide as on the real one (``_compat.hf_masks.hf_masks_as_unpadded``).
* **The kernel on CUDA.** The fake step runs on CPU, where torch picks the CPU flash kernel or the math
  path by CPU rules (no dropout, ...). For ``device="cuda"`` every ``F.scaled_dot_product_attention``
  call is redirected (:class:`CudaAttention`) to the kernel CUDA would pick (:func:`choose_cuda_kernel`,
  the rules of torch's ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``) and allocates what that
  kernel allocates (:class:`_FusedAttention`); the math path runs torch's own math composite.

The table with the sources is in ``docs/estimate.md`` ("Attention kernels").
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_lowmem._compat.fake_mode import is_fake
from lightning_lowmem._compat.hf_masks import hf_masks_as_unpadded
from lightning_lowmem._compat import tree_leaves

__all__ = ["ATTENTION_KERNELS", "CudaAttention", "batch_is_padded", "choose_cuda_kernel", "fake_attention"]

ATTENTION_KERNELS = ("auto", "flash", "efficient", "math")
"""Values of ``estimate_memory(attention_kernel=...)``: ``"auto"`` is torch's own choice on CUDA (sm80+)."""

_HALF = (torch.float16, torch.bfloat16)

_SDPA = F.scaled_dot_product_attention  # torch's own, whatever CudaAttention puts in its place while it runs


def validate_attention_kernel(attention_kernel: Any) -> str:
    """``attention_kernel`` itself, or a ``ValueError`` naming what is allowed."""
    if attention_kernel not in ATTENTION_KERNELS:
        raise ValueError(
            f"`attention_kernel`={attention_kernel!r} is unknown; choose one of {list(ATTENTION_KERNELS)} "
            f"('auto': the kernel torch picks on the GPU, the others force one as "
            f"`torch.nn.attention.sdpa_kernel` does)"
        )
    return attention_kernel


# ----------------------------------------------------------------------------- padding masks
def batch_is_padded(batch: Any) -> bool:
    """True when a real 0/1 mask of ``batch`` (a 2-D integer or bool tensor holding only 0 and 1, e.g.
    ``attention_mask``) has a 0. Masks on ``meta`` have no values: taken as unpadded (packed sequences)."""
    for leaf in tree_leaves(batch):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() != 2 or leaf.is_floating_point() or leaf.is_complex():
            continue
        if leaf.device.type == "meta" or is_fake(leaf) or leaf.numel() == 0:
            continue
        ones = leaf == 1
        if bool(((leaf == 0) | ones).all()) and not bool(ones.all()):
            return True
    return False


# ----------------------------------------------------------------------------- CUDA's choice
def choose_cuda_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    allowed: tuple[str, ...] = ("flash", "efficient", "math"),
) -> tuple[str, list[str]]:
    """The SDPA kernel CUDA runs for these inputs on an sm80+ GPU (A100, H100), first allowed that fits.

    torch tries flash, then memory-efficient, then math (``select_sdp_backend`` in ``sdp_utils.cpp``;
    cuDNN comes first only with cuDNN > 9.15 on sm90/sm100, see ``docs/estimate.md``). Checked here:

    * flash (``can_use_flash_attention``): no ``attn_mask``; fp16 / bf16; q, k, v head dims equal and
      <= 256; causal only with equal query / key lengths; grouped-query heads allowed.
    * efficient (``can_use_mem_efficient_attention``): fp32 / fp16 / bf16; q / k head dims equal and
      q / v head dims divisible by 4 (fp32) or 8 (fp16 / bf16); masks and dropout allowed.
    * math: always.

    Returns:
        ``(kernel, reasons)``: the kernel's name and why each earlier allowed kernel was passed over;
        ``"none"`` when no allowed kernel fits.

    Example::

        >>> q = torch.empty(2, 8, 4096, 64, device="meta")
        >>> choose_cuda_kernel(q, q, q)
        ('efficient', ['flash: dtype torch.float32 (needs float16 / bfloat16)'])
        >>> choose_cuda_kernel(q.bfloat16(), q.bfloat16(), q.bfloat16())[0]
        'flash'
    """
    reasons: list[str] = []
    head_q, head_k, head_v = query.shape[-1], key.shape[-1], value.shape[-1]
    for kernel in allowed:
        if kernel == "flash":
            why = (
                "an attn_mask is given"
                if attn_mask is not None
                else f"dtype {query.dtype} (needs float16 / bfloat16)"
                if query.dtype not in _HALF
                else f"head dims {head_q}/{head_k}/{head_v} (must be equal, <= 256)"
                if not (head_q == head_k == head_v and head_q <= 256)
                else "causal with query length != key length"
                if is_causal and query.shape[-2] != key.shape[-2]
                else None
            )
        elif kernel == "efficient":
            align = 8 if query.dtype in _HALF else 4
            why = (
                f"dtype {query.dtype}"
                if query.dtype not in (torch.float32, *_HALF)
                else f"head dims {head_q}/{head_k}/{head_v} (q, k equal; q, v divisible by {align})"
                if head_q != head_k or head_q % align or head_v % align
                else None
            )
        else:
            why = None
        if why is None:
            return kernel, reasons
        reasons.append(f"{kernel}: {why}")
    return "none", reasons


# ----------------------------------------------------------------------------- the fused kernels' memory
def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _like_kernel_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(B, H, T, D) laid out as (B, T, H, D), as CUDA's fused kernels write their outputs and gradients."""
    return torch.empty_permuted(shape, (0, 2, 1, 3), dtype=dtype, device=device)


class _FusedAttention(torch.autograd.Function):
    """Allocates what CUDA's flash / memory-efficient kernel allocates; computes nothing (fake tensors).

    Forward keeps the output and the float32 log-sum-exp for backward (flash: (B, H, T); efficient:
    (B, H, T rounded up to 32)); philox seed / offset are CPU scalars outside CUDA-graph capture. Backward
    returns grad q / k / v (in q / k / v's dtype, (B, T, H, D) layout) and holds the kernel's workspace
    while it runs: flash (``mha_bwd``) a float32 ``softmax_d`` (B, H, T_128) and ``dq_accum``
    (B, T_128, H, D rounded up to 32, 256 above 192) plus, for grouped-query heads, dk / dv expanded to the
    query heads; efficient (``_efficient_attention_backward``) a float32 ``delta`` (B, H, T) and the
    split-key kernel's float32 grad-q accumulator (~(B, H, T, D); per-block grad-k / grad-v scratch of
    fp16 / bf16 kernels is not modelled: it does not grow with T).
    """

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Any, kernel: str) -> Any:
        batch, heads, length = query.shape[:3]
        output = _like_kernel_output((*query.shape[:3], value.shape[-1]), query.dtype, query.device)
        lse_length = length if kernel == "flash" else _round_up(length, 32)
        logsumexp = torch.empty((batch, heads, lse_length), dtype=torch.float32, device=query.device)
        ctx.kernel = kernel
        tensors = (query, key, value, output, logsumexp) + ((bias,) if isinstance(bias, torch.Tensor) else ())
        ctx.save_for_backward(*tensors)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        query, key, value = ctx.saved_tensors[:3]
        batch, heads, length, head_dim = query.shape
        device, rows = query.device, _round_up(length, 128)
        workspace = [torch.empty((batch, heads, rows), dtype=torch.float32, device=device)]  # softmax_d / delta
        if ctx.kernel == "flash":
            head_rounded = _round_up(head_dim, 32) if head_dim <= 192 else 256
            workspace.append(torch.empty((batch, rows, heads, head_rounded), dtype=torch.float32, device=device))
            if key.shape[1] != heads:  # grouped-query: gradients for every query head, summed afterwards
                expanded = (batch, heads, key.shape[2], key.shape[3])
                workspace += [_like_kernel_output(expanded, key.dtype, device) for _ in range(2)]
        else:  # split-key kernels (sm70+) accumulate grad q in float32, every dtype
            workspace.append(torch.empty((batch, heads, rows, head_dim), dtype=torch.float32, device=device))
        grads = tuple(_like_kernel_output(tuple(t.shape), t.dtype, device) for t in (query, key, value))
        del workspace
        return (*grads, None, None)


def _efficient_bias(attn_mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The additive bias the efficient kernel reads: a bool mask converted to q's dtype (torch's
    ``convert_boolean_attn_mask``), the last dim padded to a multiple of 16 (``preprocess_mask``)."""
    bias = attn_mask
    if attn_mask.dtype == torch.bool:
        bias = torch.empty(attn_mask.shape, dtype=query.dtype, device=attn_mask.device)
    length = bias.shape[-1]
    if length % 16:
        bias = torch.empty((*bias.shape[:-1], _round_up(length, 16)), dtype=bias.dtype, device=bias.device)
    return bias


class CudaAttention(TorchFunctionMode):
    """Inside the fake step: each ``F.scaled_dot_product_attention`` runs as CUDA's kernel would.

    Args:
        attention_kernel: ``"auto"`` (torch's choice, :func:`choose_cuda_kernel`) or one kernel forced
            (``"flash"``, ``"efficient"``, ``"math"``), as under ``torch.nn.attention.sdpa_kernel``.

    ``self.chosen`` counts the kernels run (``{"flash": 4}``, a checkpointed block's recomputation included),
    for the report's meta.

    Activation checkpointing recomputes a block's forward inside backward, where autograd's engine runs
    without the torch-function modes of the forward: there a call would reach CPU's kernel, which saves other
    tensors than the forward did (``CheckpointError``, so no half-precision plan for CUDA could checkpoint). While
    the mode is entered, ``torch.nn.functional.scaled_dot_product_attention`` is therefore also this mode's
    :meth:`attend` (restored on exit); the mode still catches a reference to torch's function taken earlier.
    """

    def __init__(self, attention_kernel: str = "auto") -> None:
        super().__init__()
        self.attention_kernel = validate_attention_kernel(attention_kernel)
        self.chosen: dict[str, int] = {}
        self._replaced: Any = None

    def __enter__(self) -> "CudaAttention":
        self._replaced = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self.attend  # seen by checkpoint recomputation too (class docstring)
        try:
            return super().__enter__()
        except BaseException:
            F.scaled_dot_product_attention = self._replaced
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            F.scaled_dot_product_attention = self._replaced

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        return self.attend(*args, **kwargs)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):  # CPU autocast stands in for CUDA's, which casts SDPA's inputs
            dtype = torch.get_autocast_dtype("cpu")
            query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
            with torch.autocast("cpu", enabled=False):
                return self.attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        allowed = ("flash", "efficient", "math") if self.attention_kernel == "auto" else (self.attention_kernel,)
        kernel, reasons = choose_cuda_kernel(query, key, value, attn_mask, is_causal, allowed)
        if kernel == "none":
            from lightning_lowmem.planning._fake_step import EstimationError

            raise EstimationError(
                f"`attention_kernel`={self.attention_kernel!r} cannot run this attention on CUDA "
                f"(q {tuple(query.shape)} {query.dtype}, mask {'yes' if attn_mask is not None else 'no'}): "
                f"{'; '.join(reasons)}. Use attention_kernel='auto', or a precision / model that fits the kernel."
            )
        self.chosen[kernel] = self.chosen.get(kernel, 0) + 1
        if kernel == "math":
            # torch's math composite, op by op, as CUDA runs it: (B, H, T, T) scores, softmax, dropout mask
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
            )[0]
        bias = _efficient_bias(attn_mask, query) if kernel == "efficient" and attn_mask is not None else None
        return _FusedAttention.apply(query, key, value, bias, kernel)


@contextlib.contextmanager
def fake_attention(batch: Any, device: str, attention_kernel: str = "auto") -> Iterator[CudaAttention | None]:
    """Around a fake step: attention as the real step on ``device`` runs it (module docstring).

    Enter it *before* the batch is faked (the masks' values are read here). Yields the
    :class:`CudaAttention` mode for ``device="cuda"`` (its ``chosen`` counts the kernels), else ``None``.
    """
    validate_attention_kernel(attention_kernel)
    with contextlib.ExitStack() as stack:
        if not batch_is_padded(batch):
            stack.enter_context(hf_masks_as_unpadded())
        mode = stack.enter_context(CudaAttention(attention_kernel)) if device == "cuda" else None
        yield mode
