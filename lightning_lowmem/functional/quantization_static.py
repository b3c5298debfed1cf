"""Static int8 quantization through ``torchao.quantization.pt2e``: export -> prepare -> calibrate -> convert.

The result is a new ``torch.fx.GraphModule`` (the exported program's module) with int8 weights and
quantize/dequantize nodes around every Linear/Conv that the x86 Inductor quantizer annotates. In eager
mode it runs the reference (dequantize -> float op -> quantize) graph, slower than float;
:func:`lightning_lowmem.functional.quantization_compile.compile_inference` lowers it to fused oneDNN int8
kernels (x86), the fast CPU path. ``.eval()``/``.train()`` work on the result (as Lightning needs).
Nothing here imports Lightning.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from lightning_lowmem.functional.quantization import QuantizationReport
from lightning_lowmem.memory.measure import state_bytes
from lightning_lowmem.warnings import NoEffectWarning

__all__ = ["quantize_static"]

_STATIC_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d)


def _drop_unused_state(graph_module: torch.fx.GraphModule) -> None:
    """Delete parameters/buffers no graph node reads (convert leaves the float originals behind)."""
    used = {str(node.target) for node in graph_module.graph.nodes if node.op in ("get_attr", "call_module")}
    for name in [name for name, _ in graph_module.named_parameters()] + [name for name, _ in graph_module.named_buffers()]:
        if name not in used:
            owner_name, _, attribute = name.rpartition(".")
            delattr(graph_module.get_submodule(owner_name), attribute)
    for name, child in list(graph_module.named_children()):
        if not any(target == name or target.startswith(name + ".") for target in used):
            delattr(graph_module, name)


def quantize_static(
    module: nn.Module,
    example_inputs: tuple[Any, ...],
    calibration_batches: Iterable[Any],
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    skip_modules: Sequence[str] = (),
) -> QuantizationReport:
    """Static int8 (weights + activations) with calibrated activation scales, via pt2e.

    Args:
        module: the float model; it is put in eval mode and not modified otherwise.
        example_inputs: a tuple of inputs used to export the model (shapes of a real batch).
        calibration_batches: input tuples (or single tensors) run through the observed model.
        filter_fn: ``filter_fn(layer, fqn) -> bool`` chooses Linear/Conv layers. Default: all.
        skip_modules: names of submodules kept in float. Default: ``()``.

    Returns:
        A :class:`QuantizationReport` whose ``module`` is the converted ``GraphModule`` and
        ``converted`` the names of the quantized layers.

    Raises:
        ValueError: ``calibration_batches`` is empty.

    Example::

        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> batches = [torch.randn(8, 16) for _ in range(4)]
        >>> report = quantize_static(model, (batches[0],), batches)
        >>> report.converted
        ['0', '2']
    """
    from torchao.quantization.pt2e import allow_exported_model_train_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    batches = [batch if isinstance(batch, (tuple, list)) else (batch,) for batch in calibration_batches]
    if not batches:
        raise ValueError("`calibration_batches` is empty: static quantization needs at least one batch.")
    module.eval()
    bytes_before = state_bytes(module)["parameters"]
    skip = tuple(skip_modules)
    chosen, excluded = [], []
    for fqn, layer in module.named_modules():
        if not isinstance(layer, _STATIC_TYPES):
            continue
        keep = not any(fqn == s or fqn.startswith(s + ".") for s in skip)
        keep = keep and (filter_fn is None or filter_fn(layer, fqn))
        (chosen if keep else excluded).append(fqn)
    if not chosen:
        warnings.warn(
            f"quantize_static found no Linear/Conv layer to quantize in {type(module).__name__}: nothing "
            "was quantized.",
            NoEffectWarning,
            stacklevel=2,
        )
        return QuantizationReport("int8_static", bytes_before, bytes_before, [], module)
    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config())
    for fqn in excluded:
        quantizer.set_module_name_qconfig(fqn, None)
    with torch.no_grad():
        # the batch dimension stays dynamic so the converted module takes any batch size
        dynamic = tuple({0: torch.export.Dim.AUTO} if isinstance(x, torch.Tensor) else None for x in example_inputs)
        exported = torch.export.export(module, tuple(example_inputs), dynamic_shapes=dynamic).module()
        prepared = prepare_pt2e(exported, quantizer)
        for batch in batches:  # calibration: observers record activation ranges
            prepared(*batch)
        converted = convert_pt2e(prepared)
    _drop_unused_state(converted)
    allow_exported_model_train_eval(converted)  # Lightning calls .eval()/.train() on every submodule
    return QuantizationReport("int8_static", bytes_before, state_bytes(converted)["parameters"], chosen, converted)
