"""Compile a (quantized) model for CPU inference: ``torch.compile`` with Inductor weight freezing.

Quantized models are smaller in eager mode but not faster on CPU: torchao's int8 tensor subclasses
dispatch per op, and a pt2e ``int8_static`` graph runs reference dequantize -> float op -> quantize
nodes. Compiled with *freezing* (weights treated as constants), Inductor folds those patterns into
oneDNN int8 ``qlinear`` kernels (x86, VNNI/AMX) with the following ReLU/add fused; fp32 models get
pre-packed oneDNN/MKL weights the same way. Measured speed-ups are in ``docs/quantization.md``.
Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_lowmem._compat.compiler import inductor_freezing
from lightning_lowmem.model_io import forward_batch

__all__ = ["CompiledInference", "compile_inference"]


class CompiledInference(nn.Module):
    """Runs ``module`` compiled, under ``torch.no_grad`` with Inductor freezing on (inference only).

    Called like the module; a single dict batch (``wrapper(batch)``, as a DataLoader yields Hugging Face batches)
    is passed as keywords (``module(**batch)``, through :func:`lightning_lowmem.model_io.forward_batch`, so a
    module defining ``forward_batch(batch)`` gets it whole). Its ``state_dict`` is ``module``'s under the prefix
    ``module.``. Weights are frozen into the
    compiled code at the first call of each input shape: changing them afterwards has no effect on
    the compiled code (build a new wrapper instead).

    Args:
        module: the model (float, torchao-quantized or the ``GraphModule`` of ``int8_static``).
        dynamic: passed to ``torch.compile``. Default: ``None``: ``False`` (one compilation per input
            shape) when ``module`` holds torchao-quantized weights, whose tensor subclasses fail to
            trace with dynamic shapes in torch 2.13; otherwise torch's default (static first, dynamic
            after a shape change).
    """

    def __init__(self, module: nn.Module, *, dynamic: bool | None = None) -> None:
        super().__init__()
        module.eval()  # not chained: an exported model's patched eval() returns None
        self.module = module
        if dynamic is None and any(type(p) not in (torch.Tensor, nn.Parameter) for p in module.parameters()):
            dynamic = False
        self.module.compile(dynamic=dynamic)  # in place: keeps parameter names, compiles at first call

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # freezing must be on whenever dynamo (re)traces, i.e. at any call with a new input shape
        with torch.no_grad(), inductor_freezing():
            if len(args) == 1 and not kwargs and isinstance(args[0], Mapping):  # a dict batch: keywords
                return forward_batch(self.module, args[0])
            return self.module(*args, **kwargs)


def compile_inference(
    module: nn.Module,
    example_inputs: tuple[Any, ...] | Mapping[str, Any] | None = None,
    *,
    dynamic: bool | None = None,
) -> CompiledInference:
    """Compile ``module`` for inference with frozen weights (the fast CPU path for int8 models).

    Args:
        module: the model to run; compiled in place (``nn.Module.compile``) and put in eval mode.
        example_inputs: if given, the model is run once on them so the compilation (seconds to a
            minute) happens now rather than at the first real call: a tuple of positional inputs, or a dict
            batch (``input_ids``, ``attention_mask``, ...: passed as keywords; ``(batch,)`` too). Default: ``None``.
        dynamic: passed to ``torch.compile``. Default: ``None`` (see :class:`CompiledInference`).

    Returns:
        A :class:`CompiledInference` wrapping ``module``; call it like the module.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or ``example_inputs`` is not a tuple or a dict.

    Example::

        >>> from lightning_lowmem.functional.quantization.ptq import quantize_
        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> batches = [torch.randn(8, 16) for _ in range(4)]
        >>> quantized = quantize_(model, "int8_static", calibration_data=batches).module
        >>> fast = compile_inference(quantized, (batches[0],))  # doctest: +SKIP
        >>> fast(batches[1]).shape  # doctest: +SKIP
        torch.Size([8, 4])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be an nn.Module, got {type(module).__name__}.")
    if example_inputs is not None and not isinstance(example_inputs, (tuple, Mapping)):
        raise TypeError(
            f"`example_inputs` must be a tuple of positional inputs or a dict batch, got "
            f"{type(example_inputs).__name__}; wrap a single tensor as `(tensor,)`."
        )
    compiled = CompiledInference(module, dynamic=dynamic)
    if isinstance(example_inputs, Mapping):
        compiled(example_inputs)
    elif example_inputs is not None:
        compiled(*example_inputs)
    return compiled
