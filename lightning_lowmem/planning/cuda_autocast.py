"""CUDA autocast's op rules in a fake step, which runs on CPU.

A ``device="cuda"`` estimate runs the step on fake *CPU* tensors, so ``torch.autocast("cuda")`` casts nothing
(it acts on CUDA tensors only) and CPU autocast decides each op's dtype. The two differ where it matters for
memory: CUDA autocast runs softmax / log_softmax / layer_norm / the losses / ``sum`` / ``exp`` / ``pow`` ... in
float32 (their outputs, often saved for backward, are twice the bytes), CPU autocast leaves most of them in
the lower precision. While :func:`cuda_autocast_rules` is entered, CPU autocast runs CUDA's rules instead: a
kernel for each op of CUDA's lists is registered on CPU autocast's dispatch key (``torch.library``), and
removed on exit. Autocast's other behaviour stays CPU autocast's own, which is CUDA's too: the matmul /
convolution / attention list in the lower precision, and the cache of the lower-precision copies of weights
(leaf tensors that require grad), kept until the autocast region exits -- when the runner turns it on:
``estimate_memory(autocast_cache=...)``, off by default as Lightning's ``MixedPrecision`` plugin runs autocast.

The lists are torch's, from ``aten/src/ATen/autocast_mode.cpp`` (``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_PROMOTE``, and the CUDA-only entries of
``AT_FORALL_LOWER_PRECISION_FP``), as the CUDA autocast documentation lists them
(https://pytorch.org/docs/stable/amp.html#cuda-ops-that-can-autocast-to-float32). Ops in CPU autocast's own
float32 list that CUDA's lacks (``binary_cross_entropy``, FFTs, some linear algebra) keep CPU's rule.

The registration is process-wide while entered (the estimator's own step; a real CPU autocast in another
thread would see CUDA's rules meanwhile).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import torch

from lightning_lowmem._compat.dispatcher import below_cpu_autocast, drop_library

__all__ = ["FP32", "FP32_SET_OPT_DTYPE", "LOWER_PRECISION", "PROMOTE", "cuda_autocast_rules"]

FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
    "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)  # fmt: skip
"""Run in float32: half-precision inputs are cast up."""

FP32_SET_OPT_DTYPE = (
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum",
)  # fmt: skip
"""Run with ``dtype=torch.float32`` when no dtype is given and the first input is a float tensor."""

PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")  # fmt: skip
"""Run in the widest floating dtype of their inputs."""

LOWER_PRECISION = ("addmv", "addr", "mv", "chain_matmul", "linalg_multi_dot", "lstm_cell", "gru_cell",
                   "rnn_tanh_cell", "rnn_relu_cell")  # fmt: skip
"""CUDA's lower-precision ops that CPU autocast's list lacks (the rest of CUDA's list is CPU's too)."""

_HALF = (torch.float16, torch.bfloat16)


def _eligible(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast(values: Any, dtype: torch.dtype, when: Callable[[torch.Tensor], bool]) -> Any:
    if isinstance(values, (list, tuple)):
        return type(values)(_cast(value, dtype, when) for value in values)
    if _eligible(values) and values.dtype != dtype and when(values):
        return values.to(dtype)
    return values


def _floats(values: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, (list, tuple)):
            found += _floats(value)
        elif _eligible(value):
            found.append(value)
    return found


def _kernel(op: Any, policy: str, lower: torch.dtype) -> Callable[..., Any]:
    dtype_index = next((i for i, arg in enumerate(op._schema.arguments) if arg.name == "dtype"), None)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with below_cpu_autocast():
            if policy == "fp32":
                args, kwargs = (
                    _cast(args, torch.float32, lambda t: t.dtype in _HALF),
                    {k: _cast(v, torch.float32, lambda t: t.dtype in _HALF) for k, v in kwargs.items()},
                )
            elif policy == "fp32_set_opt_dtype":
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if _eligible(first) and dtype_index is not None:
                    if len(args) > dtype_index:
                        if args[dtype_index] is None:
                            args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1 :])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
            elif policy == "promote":
                floats = _floats(list(args) + list(kwargs.values()))
                if floats:
                    widest = floats[0].dtype
                    for tensor in floats[1:]:
                        widest = torch.promote_types(widest, tensor.dtype)
                    args = _cast(args, widest, lambda t: True)
                    kwargs = {k: _cast(v, widest, lambda t: True) for k, v in kwargs.items()}
            else:  # lower precision
                args = _cast(args, lower, lambda t: t.dtype == torch.float32)
                kwargs = {k: _cast(v, lower, lambda t: t.dtype == torch.float32) for k, v in kwargs.items()}
            return op(*args, **kwargs)

    return kernel


@contextlib.contextmanager
def cuda_autocast_rules(device: str, autocast_dtype: torch.dtype | None) -> Iterator[None]:
    """While entered, CPU autocast runs CUDA autocast's op rules (module docstring), for ``device="cuda"`` and a
    mixed precision (``autocast_dtype`` set); otherwise it does nothing."""
    if device != "cuda" or autocast_dtype is None:
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": CPU autocast's own
            _register(library, autocast_dtype)
        yield
    finally:
        drop_library(library)


def _register(library: Any, autocast_dtype: torch.dtype) -> None:
    for policy, names in (
        ("fp32", FP32),
        ("fp32_set_opt_dtype", FP32_SET_OPT_DTYPE),
        ("promote", PROMOTE),
        ("lower", LOWER_PRECISION),
    ):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                if "out" in overload or overload.endswith("_"):  # out= and in-place variants: not autocast's
                    continue
                op = getattr(packet, overload)
                qualified = name if overload == "default" else f"{name}.{overload}"
                library.impl(qualified, _kernel(op, policy, autocast_dtype), "AutocastCPU")
