"""Static int8 quantization through ``torchao.quantization.pt2e``: export -> prepare -> calibrate -> convert.

The result is a new ``torch.fx.GraphModule`` (the exported program's module) with int8 weights and
quantize/dequantize nodes around every Linear/Conv that the x86 Inductor quantizer annotates. Models
called with keywords (Hugging Face: ``model(**batch)``) are exported with those keywords; GPT-2's
``Conv1D`` layers are exported as exact ``nn.Linear`` (so they are quantized too); a Linear whose weight
is tied to an embedding table stays float (the table does: one stored copy); a model with a ``use_cache``
argument is exported with ``use_cache=False`` (a cache object cannot leave an exported graph), and the
result (:class:`StaticInt8Module`) passes it on every call. In eager
mode it runs the reference (dequantize -> float op -> quantize) graph, slower than float;
:func:`lightning_lowmem.functional.quantization.compile.compile_inference` lowers it to fused oneDNN int8
kernels (x86), the fast CPU path. ``.eval()``/``.train()`` work on the result (as Lightning needs).

x86 CPUs without VNNI (AVX2-only, AVX-512 before Cascade Lake) multiply u8 activations by s8 weights with
``vpmaddubsw``, whose 16-bit pair sums saturate: the compiled kernels then drift far from the reference
graph (measured: 14.5% relative error against float on an AVX2 EPYC, 1.1% with VNNI-free numerics). On
such CPUs activations are quantized to 7 bits (``reduce_range``, what torch's x86 quantizer documents for
them): no saturation, compiled = reference graph, at about twice the activation rounding error.
Nothing here imports Lightning.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from lightning_lowmem._compat.compiler import keep_vmap_nesting
from lightning_lowmem.functional.quantization.report import QuantizationReport, weight_bytes
from lightning_lowmem.functional.quantization.layers import convert_conv1d_, matches_any, set_submodule, tied_groups
from lightning_lowmem.memory.measure import state_bytes
from lightning_lowmem.warnings import NoEffectWarning

__all__ = [
    "ModelCall",
    "StaticInt8Module",
    "StaticQuantizationError",
    "cpu_has_vnni",
    "quantize_static",
    "split_reused_modules_",
]

#: what to use instead when pt2e cannot take a model: in place, no export, Conv2d weights included
_INSTEAD = (
    "Use an in-place mode instead: mode='int8_weight_only' (int8 weights of every Linear and Conv2d, about 3.7x "
    "smaller on a ResNet, no export needed) or 'int8_dynamic'."
)


class StaticQuantizationError(ValueError):
    """``int8_static`` could not take this model (export or torchao's quantizer failed); the message names
    the step, the pattern and the in-place mode to use instead."""


def split_reused_modules_(graph_module: torch.fx.GraphModule, module: nn.Module) -> list[str]:
    """Give every call of a parameter-free module that ``forward`` calls more than once its own name in the
    exported graph's ``nn_module_stack`` metadata, in place; returns the modules renamed.

    torchvision's ``BasicBlock`` calls one ``self.relu`` twice. torchao's quantizer groups the graph's nodes
    by the module they came from (``nn_module_stack``, once ``prepare_pt2e`` has dropped ``source_fn_stack``),
    so the two ReLU calls became one "partition" with two outputs and ``prepare_pt2e`` raised ``ValueError:
    Input partition has more than one output node``. Export already tells the calls apart (the stack keys of
    the second call end in ``@1``); the names get the same suffix. Modules with parameters (one Linear called
    twice) keep their name, so ``skip_modules`` still reaches every call of them.
    """
    renamed = set()
    for node in graph_module.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        key, (fqn, cls) = list(stack.items())[-1]
        call = str(key).rpartition("@")[2] if "@" in str(key) else ""
        if not call.isdigit():
            continue
        try:
            owner = module.get_submodule(fqn)
        except AttributeError:
            continue
        if next(owner.parameters(), None) is None:
            stack[key] = (f"{fqn}@{call}", cls)
            renamed.add(fqn)
    return sorted(renamed)


_STATIC_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d)


def cpu_has_vnni() -> bool:
    """Whether this CPU runs oneDNN's u8 x s8 int8 products without 16-bit saturation (AVX512-VNNI or AMX).

    Read from ``torch.cpu.get_capabilities()`` (cpuinfo), or the ``/proc/cpuinfo`` flags where torch has
    no such function. AVX-VNNI alone (AVX2-class CPUs) is not counted: reducing the range there costs a
    little accuracy, assuming VNNI wrongly would cost a lot. Non-x86 CPUs answer ``True`` (nothing to avoid).
    """
    flags = ("avx512_vnni", "amx_int8")
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is not None:
        capabilities = get_capabilities()
        if capabilities.get("architecture", "x86_64") not in ("x86_64", "x86", "i386", "AMD64"):
            return True
        return any(bool(capabilities.get(flag)) for flag in flags)
    try:  # pragma: no cover - torch < 2.8
        with open("/proc/cpuinfo") as cpuinfo:
            words = set(cpuinfo.read().split())
    except OSError:  # pragma: no cover - not Linux: assume a modern CPU
        return True
    return "avx2" not in words or any(flag in words for flag in flags)


def _drop_unused_state(graph_module: torch.fx.GraphModule) -> None:
    """Delete parameters/buffers no graph node reads (convert leaves the float originals behind)."""
    used = {str(node.target) for node in graph_module.graph.nodes if node.op in ("get_attr", "call_module")}
    for name in [name for name, _ in graph_module.named_parameters()] + [
        name for name, _ in graph_module.named_buffers()
    ]:
        if name not in used:
            owner_name, _, attribute = name.rpartition(".")
            delattr(graph_module.get_submodule(owner_name), attribute)
    for name, _child in list(graph_module.named_children()):
        if not any(target == name or target.startswith(name + ".") for target in used):
            delattr(graph_module, name)


@dataclass
class ModelCall:
    """One call of a model: ``model(*args, **kwargs)`` (a calibration batch or the export example)."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, batch: Any) -> "ModelCall":
        """A tuple / list is positional inputs, a dict keyword inputs, anything else one positional input."""
        if isinstance(batch, ModelCall):
            return batch
        if isinstance(batch, (tuple, list)):
            return cls(tuple(batch))
        if isinstance(batch, dict):
            return cls((), dict(batch))
        return cls((batch,))


class StaticInt8Module(nn.Module):
    """The exported int8 graph plus keyword arguments it was exported with and every call passes
    (``use_cache=False``); a caller's own value for them is replaced."""

    def __init__(self, graph: nn.Module, constants: dict[str, Any]) -> None:
        super().__init__()
        self.graph = graph
        self.constants = dict(constants)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.graph(*args, **{**kwargs, **self.constants})


def _has_observers(prepared: nn.Module) -> bool:
    """Did ``prepare_pt2e`` insert observers (submodules ``activation_post_process_<n>``)?"""
    return any(name.startswith("activation_post_process") for name, _ in prepared.named_children())


def _constants(module: nn.Module, call: ModelCall) -> dict[str, Any]:
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return {}
    return {"use_cache": False} if "use_cache" in parameters and "use_cache" not in call.kwargs else {}


def _dynamic_batch(value: Any) -> Any:
    """Dim 0 of every tensor dynamic (the converted module takes any batch size)."""
    if isinstance(value, torch.Tensor):
        return {0: torch.export.Dim.AUTO} if value.dim() else None
    if isinstance(value, (tuple, list)):
        return type(value)(_dynamic_batch(v) for v in value)
    if isinstance(value, dict):
        return {k: _dynamic_batch(v) for k, v in value.items()}
    return None


def _export(module: nn.Module, example: ModelCall, kwargs: dict[str, Any], dynamic: Any, strict: bool) -> nn.Module:
    """``torch.export`` of ``module`` (its ``.module()``); a failure becomes a :class:`StaticQuantizationError`
    naming what to do."""
    try:
        return torch.export.export(module, example.args, kwargs=kwargs, dynamic_shapes=dynamic, strict=strict).module()
    except Exception as error:  # torch.export raises many types (UserError, GuardOnDataDependentSymNode, ...)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        hint = (
            " A check on tensor *values* (e.g. nn.Transformer's causal-mask detection on `tgt_mask` / `src_mask`: "
            "pass `tgt_is_causal=True` beside the mask: it skips the check) cannot be exported."
            if "data-dependent" in str(error).lower() or "guard" in str(error).lower()
            else ""
        )
        raise StaticQuantizationError(
            f"int8_static: torch.export could not export {type(module).__name__} "
            f"({type(error).__name__}: {first_line}).{hint} {_INSTEAD}"
        ) from error


def quantize_static(
    module: nn.Module,
    example_inputs: tuple[Any, ...] | ModelCall,
    calibration_batches: Iterable[Any],
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    skip_modules: Sequence[str] = (),
    reduce_range: bool | None = None,
) -> QuantizationReport:
    """Static int8 (weights + activations) with calibrated activation scales, via pt2e.

    Args:
        module: the float model; it is put in eval mode and not modified otherwise.
        example_inputs: a tuple of positional inputs, or a :class:`ModelCall`, used to export the model
            (shapes of a real batch; dim 0 stays dynamic).
        calibration_batches: input tuples, keyword dicts (``model(**batch)``), :class:`ModelCall` objects
            or single tensors, run through the observed model.
        filter_fn: ``filter_fn(layer, fqn) -> bool`` chooses Linear/Conv layers. Default: all.
        skip_modules: submodules kept in float (names, dotted suffixes, globs or class names). Default: ``()``.
        reduce_range: quantize activations to 7 bits. Default: ``None``: only where the CPU lacks VNNI
            (:func:`cpu_has_vnni`), whose compiled int8 kernels saturate with 8-bit activations.

    Returns:
        A :class:`QuantizationReport` whose ``module`` is the converted ``GraphModule`` (or a
        :class:`StaticInt8Module` around it) and ``converted`` the names of the quantized layers;
        ``notes`` says when the range was reduced.

    Raises:
        ValueError: ``calibration_batches`` is empty.
        StaticQuantizationError: the model cannot be exported, or torchao's quantizer cannot annotate its
            graph (the message names the step, the error and the in-place mode to use instead).

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

    calls = [ModelCall.of(batch) for batch in calibration_batches]
    if not calls:
        raise ValueError("`calibration_batches` is empty: static quantization needs at least one batch.")
    module.eval()
    bytes_before = state_bytes(module)["parameters"]
    tied = {name for group in tied_groups(module) for name in group}
    replaced = convert_conv1d_(module)  # exact nn.Linear while exporting; put back below
    try:
        chosen, excluded = [], []
        for fqn, layer in module.named_modules():
            if not isinstance(layer, _STATIC_TYPES):
                continue
            keep = fqn not in tied and not matches_any(fqn, layer, skip_modules)
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
        converted_bytes = weight_bytes(module, chosen)
        if reduce_range is None:
            reduce_range = not cpu_has_vnni()
        quantizer = x86.X86InductorQuantizer()
        quantizer.set_global(x86.get_default_x86_inductor_quantization_config(reduce_range=reduce_range))
        for fqn in excluded:
            quantizer.set_module_name_qconfig(fqn, None)
        example = ModelCall.of(example_inputs)
        constants = _constants(module, example)
        keep_vmap_nesting()  # transformers 4.x builds masks under vmap: keep its markers in the graph
        with torch.no_grad():
            kwargs = {**example.kwargs, **constants}
            dynamic = _dynamic_batch(inspect.signature(module.forward).bind(*example.args, **kwargs).arguments)
            prepared = None
            for strict in (False, True):
                # torch >= 2.11's non-strict export records no `source_fn_stack`, which the quantizer's
                # pattern matching needs: it then inserts no observer and would quantize nothing, silently
                exported = _export(module, example, kwargs, dynamic, strict)
                split_reused_modules_(exported, module)
                try:
                    prepared = prepare_pt2e(exported, quantizer)
                except (ValueError, AssertionError) as error:
                    raise StaticQuantizationError(
                        f"int8_static: torchao's X86InductorQuantizer could not annotate the graph of "
                        f"{type(module).__name__}: {type(error).__name__}: {error}. It matches conv/linear + add + "
                        "relu patterns by the module each node came from; a module with weights called more than "
                        f"once in one forward, or an op it does not expect inside such a pattern, stops it. {_INSTEAD}"
                    ) from error
                if _has_observers(prepared):
                    break
            else:
                raise RuntimeError(
                    f"int8_static: torchao's X86InductorQuantizer inserted no observer into the exported graph of "
                    f"{type(module).__name__} (torch {torch.__version__}), so nothing would be quantized. Use an "
                    "in-place mode instead, e.g. mode='int8_dynamic' or 'int8_weight_only'."
                )
            for call in calls:  # calibration: observers record activation ranges
                prepared(*call.args, **{**call.kwargs, **constants})
            converted = convert_pt2e(prepared)
    finally:
        for name, conv1d in replaced.items():
            set_submodule(module, name, conv1d)
    _drop_unused_state(converted)
    allow_exported_model_train_eval(converted)  # Lightning calls .eval()/.train() on every submodule
    result: nn.Module = StaticInt8Module(converted, constants) if constants else converted
    notes = ["activations in 7 bits (reduce_range: this CPU has no VNNI)"] if reduce_range else []
    conv1d = [name for name in replaced if name in chosen]
    bytes_after = state_bytes(converted)["parameters"]
    return QuantizationReport(
        "int8_static", bytes_before, bytes_after, chosen, result, conv1d, [], converted_bytes, notes
    )
