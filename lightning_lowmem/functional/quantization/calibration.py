"""Static int8 of one child module: choose its layers, record its calibration calls, build its int8 graph.

A LightningModule cannot replace itself, so ``PostTrainingQuantization(mode="int8_static")`` exports one
submodule, ``module_name`` (e.g. the ``model`` its ``forward`` calls). These helpers choose that child's
layers, record the calls (positional and keyword inputs) it receives while the package runs the model on
batches (already on the model's device), and build the int8 graph of a copy of it; :class:`StaticChild`
bundles them with the one piece of state a run needs between the accuracy search and the conversion (the
last graph built). The callback decides when.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from lightning_lowmem.functional.quantization.layers import is_conv1d, matches_any, set_submodule, tied_groups
from lightning_lowmem.functional.quantization.report import QuantizationReport
from lightning_lowmem.model_io import BatchCallError, forward_batch
from lightning_lowmem.warnings import NoEffectWarning

__all__ = ["StaticChild", "calibration_calls", "device_of", "quantize_child", "static_candidates"]

STATIC_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d)


def device_of(module: nn.Module) -> torch.device:
    """Where ``module`` lives (an exported int8 graph may hold its weights as buffers only)."""
    tensor = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def static_candidates(
    pl_module: nn.Module,
    module_name: str,
    skip_modules: Sequence[str],
    filter_fn: Callable[[nn.Module, str], bool] | None,
) -> list[str]:
    """The child's Linear / Conv / Conv1D layers (qualified from ``pl_module``), except tied ones (they stay
    float with their embedding table: one stored copy) and those ``skip_modules`` / ``filter_fn`` leave out."""
    child = pl_module.get_submodule(module_name)
    tied = {f"{module_name}.{name}" for group in tied_groups(child) for name in group}
    names = []
    for fqn, layer in child.named_modules(prefix=module_name):
        if not (isinstance(layer, STATIC_TYPES) or is_conv1d(layer)) or fqn in tied:
            continue
        if matches_any(fqn, layer, skip_modules) or (filter_fn is not None and not filter_fn(layer, fqn)):
            continue
        names.append(fqn)
    return names


def calibration_calls(pl_module: nn.Module, module_name: str, loader: Iterable[Any], batches: int) -> list[Any]:
    """The calls (positional and keyword inputs) the child ``module_name`` receives on the first ``batches``
    batches of ``loader`` (on the model's device), the model being run as the package always runs it
    (:func:`~lightning_lowmem.model_io.forward_batch`).

    Raises:
        BatchCallError: the model cannot be called on these batches (names the override point).
        ValueError: the child was never called.
    """
    from lightning_lowmem.functional.quantization.static import ModelCall

    captured: list[ModelCall] = []

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        detach = lambda value: value.detach() if isinstance(value, torch.Tensor) else value  # noqa: E731
        captured.append(ModelCall(tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()}))

    handle = pl_module.get_submodule(module_name).register_forward_pre_hook(record, with_kwargs=True)
    was_training = pl_module.training
    pl_module.eval()
    try:
        with torch.no_grad():
            for index, batch in enumerate(loader):
                if index >= batches:
                    break
                try:
                    forward_batch(pl_module, batch)
                except BatchCallError as err:
                    raise BatchCallError(
                        f"PostTrainingQuantization(mode='int8_static') calibrates by running the model: {err}"
                    ) from None
    finally:
        handle.remove()
        pl_module.train(was_training)
    if not captured:
        raise ValueError(
            f"`module_name`={module_name!r} was never called while the model ran on {batches} validation batches; "
            "name the submodule your forward / forward_batch actually calls."
        )
    return captured


def quantize_child(
    pl_module: nn.Module, module_name: str, names: Sequence[str], calibration: list[Any], *, compile: bool = False
) -> QuantizationReport:
    """Static int8 of a copy of the child with exactly ``names`` quantized (``report.module``: to install)."""
    from lightning_lowmem.functional.quantization.compile import compile_inference
    from lightning_lowmem.functional.quantization.static import quantize_static

    prefix = f"{module_name}."
    chosen = {name.removeprefix(prefix) for name in names}
    child = copy.deepcopy(pl_module.get_submodule(module_name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoEffectWarning)  # evaluating "none quantized" is expected
        report = quantize_static(child, calibration[0], calibration, filter_fn=lambda _, fqn: fqn in chosen)
    report.converted = [prefix + name for name in report.converted]
    report.conv1d = [prefix + name for name in report.conv1d]
    if compile:
        report.module = compile_inference(report.module)
    return report


class StaticChild:
    """The child ``module_name`` of a model, replaced by its calibrated int8 graph: the state a static int8
    run keeps between the accuracy search and the final conversion (the last graph built, so the chosen
    configuration is not exported twice).

    Args:
        module_name: the submodule replaced (e.g. ``"model"``).
        compile: wrap the final graph in :func:`~lightning_lowmem.functional.quantization.compile.compile_inference`.
            Default: ``False``.

    Example::

        >>> model = nn.Sequential()
        >>> model.add_module("model", nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
        >>> StaticChild("model").candidates(model, ["model.2"], None)
        ['model.0']
    """

    def __init__(self, module_name: str, compile: bool = False) -> None:
        self.module_name, self.compile = module_name, compile
        self._last: tuple[tuple[str, ...], QuantizationReport] | None = None

    def candidates(
        self,
        module: nn.Module,
        skip_modules: Sequence[str] = (),
        filter_fn: Callable[[nn.Module, str], bool] | None = None,
    ) -> list[str]:
        """See :func:`static_candidates`."""
        return static_candidates(module, self.module_name, skip_modules, filter_fn)

    def calibrate(self, module: nn.Module, batches: Iterable[Any], limit: int) -> list[Any]:
        """See :func:`calibration_calls`."""
        return calibration_calls(module, self.module_name, batches, limit)

    def build(
        self, module: nn.Module, names: Sequence[str], calls: list[Any], *, compile: bool | None = None
    ) -> QuantizationReport:
        """The int8 graph of the child with exactly ``names`` quantized (``report.module``, to install); the
        graph :meth:`evaluating` built last for the same ``names`` is reused."""
        compile = self.compile if compile is None else compile
        evaluated, self._last = self._last, None
        if evaluated is not None and evaluated[0] == tuple(names):  # the search already built it: no second export
            report = evaluated[1]
            if compile:
                from lightning_lowmem.functional.quantization.compile import compile_inference

                report.module = compile_inference(report.module)
            return report
        return quantize_child(module, self.module_name, names, calls, compile=compile)

    def install(self, module: nn.Module, graph: nn.Module) -> nn.Module:
        """Install ``graph`` as the child; returns the module it replaced."""
        return set_submodule(module, self.module_name, graph)

    @contextmanager
    def evaluating(self, module: nn.Module, names: Sequence[str], calls: list[Any]) -> Iterator[nn.Module]:
        """``module`` with the child's int8 graph (exactly ``names`` quantized) inside the block, the float
        child again after it; no ``names``: the float model."""
        if not names:
            yield module
            return
        report = self.build(module, names, calls, compile=False)
        self._last = (tuple(names), report)
        previous = self.install(module, report.module)
        try:
            yield module
        finally:
            self.install(module, previous)
