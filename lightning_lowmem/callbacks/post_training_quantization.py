"""`PostTrainingQuantization`: quantize at the end of ``fit``, optionally within an accuracy tolerance."""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import lightning as L
from lightning.pytorch.utilities import move_data_to_device, rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_lowmem.callbacks import _ptq_static
from lightning_lowmem.checkpoints import quantized as _quantized_checkpoints
from lightning_lowmem.checkpoints.quantized import (  # re-exported: the documented import path
    CHECKPOINT_KEY,
    load_quantized_checkpoint,
    quantize_like_checkpoint,
)
from lightning_lowmem.functional.quantization.ptq import (
    MODES,
    QuantizationReport,
    _include_embeddings,
    _quantize_layers,
    _unsupported_reason,
    measure_latency,
    quantizable_layers,
    quantize_,
    search_float_fallback,
)
from lightning_lowmem.functional.quantization.layers import check_patterns, set_submodule, tied_groups
from lightning_lowmem.memory.measure import state_bytes
from lightning_lowmem.memory.units import format_bytes
from lightning_lowmem.model_io import BatchCallError, forward_batch, has_forward_batch, model_inputs
from lightning_lowmem.warnings import LowMemWarning, NoEffectWarning

__all__ = ["PostTrainingQuantization", "load_quantized_checkpoint", "quantize_like_checkpoint"]

def _expand(units: dict[str, list[str]], chosen: Sequence[str]) -> list[str]:
    return [name for unit in chosen for name in units[unit]]


class PostTrainingQuantization(L.Callback):
    """Quantize the model's ``nn.Linear`` / ``Conv1D`` layers and ``nn.Embedding`` tables with torchao at the end
    of ``fit``.

    Hugging Face models work as they are: GPT-2's ``Conv1D`` layers become exact ``nn.Linear`` layers and
    are quantized, tied weights (head = token table) are quantized once and stay tied (see
    :mod:`lightning_lowmem.functional.quantization.ptq`). Where the callback runs the model itself (latency
    timing, ``int8_static`` calibration) it calls it the way the package always does,
    :func:`lightning_lowmem.model_io.forward_batch`: your module's ``forward_batch(self, batch)`` if you
    define one, else ``module(**batch)`` for a dict batch, ``module(batch[0])`` for a tuple; a batch that
    does not fit ``forward`` raises ``BatchCallError`` naming that override point (for ``int8_static``, at
    the first training batch; latency timing is skipped with a warning instead). The metric search runs
    your own ``validation_step``.

    With ``monitor`` and ``tolerance``, the quantized model is evaluated on the validation loader;
    while the drop of ``monitor`` exceeds ``tolerance``, the layers whose quantization alone hurts
    the metric most (measured, one evaluation per layer) are kept in float. If no mix meets the
    tolerance the model is left entirely in float (never half-converted). A before/after table (size,
    CPU latency per batch, metric, layers kept in float) is printed and kept in :attr:`summary`.

    ``mode="int8_static"`` (the fast CPU path) replaces the child module ``module_name`` (e.g. the
    ``model`` a LightningModule's ``forward`` calls) by its pt2e int8 graph, calibrated on the inputs
    that child receives during ``calibration_batches`` validation batches; with ``compile=True`` the
    graph is wrapped in :class:`~lightning_lowmem.functional.quantization.compile.CompiledInference`
    (oneDNN int8 kernels, inference only). Later ``validate``/``test``/``predict`` use it.

    Checkpoints record what wrote them (``checkpoint["lowmem_quantization"]``) and hold the torchao
    weights in a portable form (any ``map_location``; ``weights_only=True`` after ``import lightning_lowmem``).
    When this callback is in a Trainer that loads one (``fit/validate/test(ckpt_path=...)``), the layers
    take the checkpoint's quantized weights before they load, whatever the mode. Without a Trainer use
    :func:`load_quantized_checkpoint`, or call :func:`quantize_like_checkpoint` in ``on_load_checkpoint``
    for ``load_from_checkpoint``; a loader with neither fails on a state-dict entry whose key says which to
    add. An ``int8_static`` model is for inference in this process: keep the float checkpoint to reload.

    Args:
        mode: ``"int8_dynamic"``, ``"int8_weight_only"``, ``"int4_weight_only"`` (CUDA),
            ``"intx4_weight_only"`` or ``"int8_static"`` (needs ``module_name``). Default: ``"int8_dynamic"``.
        skip_modules: submodules kept in float: qualified names, dotted suffixes (``"lm_head"``), fnmatch
            globs (``"*.attn.*"``) or class names; an entry naming nothing raises at ``setup``, listing the
            model's layers. Default: ``()``.
        filter_fn: ``filter_fn(layer, fqn) -> bool``; not YAML-serialisable, prefer ``skip_modules``
            in configs. Default: ``None``.
        embeddings: quantize ``nn.Embedding`` tables too (weight-only: int8 per row, int4 values in
            groups for the int4 modes). Default: ``None``: yes, except with ``int8_static`` (which
            leaves them float; ``True`` there raises).
        monitor: a metric logged in ``validation_step`` (e.g. ``"val_acc"``). Default: ``None``.
        tolerance: largest allowed drop of ``monitor`` (in its units). Needs ``monitor``. Default: ``None``.
        monitor_mode: ``"max"`` if higher ``monitor`` is better, ``"min"`` otherwise. Default: ``"max"``.
        group_size: group length of the int4 modes. Default: ``32``.
        latency_batches: times the first validation batch is run for the latency column (``0`` disables).
            On CPU, eager torchao int8 is *slower* than float (the table says so); the fast path is
            ``int8_static`` with ``compile=True``. Default: ``10``.
        module_name: ``int8_static`` only: the submodule replaced by its int8 graph. Default: ``None``.
        calibration_batches: ``int8_static`` only: validation batches run to calibrate. Default: ``8``.
        compile: ``int8_static`` only: compile the int8 graph for inference (oneDNN kernels; the first
            call of each input shape compiles). Default: ``False``.

    Raises:
        ValueError: unknown ``mode`` / ``monitor_mode``, ``tolerance`` without ``monitor`` or < 0,
            ``int8_static`` without ``module_name`` or with ``embeddings=True``, ``module_name`` /
            ``compile`` with another mode; at ``setup``: a mode the Trainer's device cannot run (e.g.
            ``int4_weight_only`` without CUDA: use ``intx4_weight_only``), a ``skip_modules`` entry or
            ``module_name`` naming nothing.
        TypeError: ``skip_modules`` is a string, ``embeddings`` not a bool or ``None``.

    Example::

        >>> callback = PostTrainingQuantization("int8_weight_only", monitor="val_acc", tolerance=0.01)
        >>> fast = PostTrainingQuantization("int8_static", module_name="model", compile=True)
    """

    def __init__(
        self,
        mode: str = "int8_dynamic",
        *,
        skip_modules: Sequence[str] = (),
        filter_fn: Callable[[nn.Module, str], bool] | None = None,
        embeddings: bool | None = None,
        monitor: str | None = None,
        tolerance: float | None = None,
        monitor_mode: str = "max",
        group_size: int = 32,
        latency_batches: int = 10,
        module_name: str | None = None,
        calibration_batches: int = 8,
        compile: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"`mode`={mode!r} is not a known quantization mode; choose one of {list(MODES)}.")
        if mode == "int8_static" and not module_name:
            raise ValueError(
                "`mode`='int8_static' needs `module_name`: the submodule (e.g. 'model') to replace by its exported "
                "int8 graph, since a LightningModule itself cannot be replaced."
            )
        if mode != "int8_static" and (module_name is not None or compile):
            raise ValueError(
                f"`module_name`={module_name!r} / `compile`={compile!r} apply to mode='int8_static' only, got "
                f"mode={mode!r}; to compile a torchao-quantized model use "
                "lightning_lowmem.functional.quantization.compile.compile_inference(model)."
            )
        if not isinstance(calibration_batches, int) or calibration_batches <= 0:
            raise ValueError(f"`calibration_batches` must be an int > 0, got {calibration_batches!r}.")
        if tolerance is not None and monitor is None:
            raise ValueError(f"`tolerance`={tolerance!r} needs `monitor` (the logged metric to keep within it).")
        if tolerance is not None and (not isinstance(tolerance, (int, float)) or tolerance < 0):
            raise ValueError(f"`tolerance` must be a number >= 0, got {tolerance!r}.")
        if monitor_mode not in ("max", "min"):
            raise ValueError(f"`monitor_mode`={monitor_mode!r} must be 'max' or 'min'.")
        if isinstance(skip_modules, str):
            raise TypeError(f"`skip_modules` must be a list of module names, got the string {skip_modules!r}.")
        _include_embeddings(mode, embeddings)  # validates it
        self.mode = mode
        self.skip_modules = list(skip_modules)
        self.filter_fn = filter_fn
        self.embeddings = embeddings
        self.monitor = monitor
        self.tolerance = tolerance
        self.monitor_mode = monitor_mode
        self.group_size = group_size
        self.latency_batches = latency_batches
        self.module_name = module_name
        self.calibration_batches = calibration_batches
        self.compile = compile
        self.quantized: list[str] = []
        self.conv1d: list[str] = []
        self.tied: list[list[str]] = []
        self.summary: dict[str, Any] = {}
        self._hook_handle: Any = None
        self._call_checked = False
        self._time_latency = latency_batches > 0
        self._last_static: tuple[tuple[str, ...], QuantizationReport] | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.mode)

    # --- checkpoints -----------------------------------------------------------------------------------

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device.type
        reason = _unsupported_reason(self.mode, device)
        if reason is not None:  # now, not after the whole fit
            raise ValueError(f"`mode`={self.mode!r} cannot run on this Trainer's device {device!r}: {reason}")
        if self.module_name is not None:
            try:
                pl_module.get_submodule(self.module_name)
            except AttributeError:
                children = [name for name, _ in pl_module.named_children()]
                raise ValueError(
                    f"`module_name`={self.module_name!r} is not a submodule of {type(pl_module).__name__}; "
                    f"its children are {children}."
                ) from None
        if not self.quantized:  # names of the float model (an int8_static child is a graph afterwards)
            check_patterns(pl_module, self.skip_modules, "skip_modules", self._candidates(pl_module, skip=False))
        if self._hook_handle is None:
            self._hook_handle = pl_module.register_load_state_dict_pre_hook(self._prepare_before_load)

    def _prepare_before_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """The layers whose incoming weights are quantized take them (any mode), so they load in place."""
        names, conv1d = _quantized_checkpoints.prepare_for_load(module, state_dict, prefix)
        self.quantized = sorted(set(self.quantized) | set(names))
        self.conv1d = sorted(set(self.conv1d) | set(conv1d))
        self.tied = [group for group in tied_groups(module) if set(group) <= set(self.quantized)]

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.quantized:
            _quantized_checkpoints.record_checkpoint(
                checkpoint, f"PostTrainingQuantization(mode={self.mode!r})", self.state_dict(),
                instruct=self.mode == "int8_static",
            )  # fmt: skip

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "group_size": self.group_size, "quantized": list(self.quantized),
            "conv1d": list(self.conv1d), "tied": [list(group) for group in self.tied],
        }  # fmt: skip

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.quantized = list(state_dict.get("quantized", []))
        self.conv1d = list(state_dict.get("conv1d", []))
        self.tied = [list(group) for group in state_dict.get("tied", [])]

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._call_checked:  # at the first batch, not after the whole fit
            self._call_checked = True
            self._check_batch_call(pl_module, batch)

    def _check_batch_call(self, pl_module: L.LightningModule, batch: Any) -> None:
        """Whether the package can call the model on a batch like this one (signature only, no forward)."""
        if has_forward_batch(pl_module) or not (self.mode == "int8_static" or self._time_latency):
            return
        from lightning_lowmem.model_io import _check_signature

        try:
            args, kwargs = model_inputs(batch)
            _check_signature(pl_module, args, kwargs, batch)
        except BatchCallError as err:
            if self.mode == "int8_static":
                raise BatchCallError(f"PostTrainingQuantization(mode='int8_static') calibrates by running the model: {err}") from None
            self._skip_latency(err)

    def _skip_latency(self, err: Exception) -> None:
        self._time_latency = False
        warnings.warn(f"PostTrainingQuantization: the latency column is not timed: {err}", LowMemWarning, stacklevel=3)

    # --- quantization ----------------------------------------------------------------------------------

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.quantize(trainer, pl_module)

    def quantize(self, trainer: L.Trainer, pl_module: L.LightningModule) -> QuantizationReport | None:
        """Quantize ``pl_module`` now (called at fit end; callable on demand, e.g. before ``test``)."""
        candidates = self._candidates(pl_module)
        if not candidates:
            if not self.quantized:
                warnings.warn(
                    f"PostTrainingQuantization(mode={self.mode!r}) found no quantizable nn.Linear / Conv1D / nn.Embedding "
                    f"layer in {type(pl_module).__name__}: the model stays in float.",
                    NoEffectWarning,
                    stacklevel=2,
                )
            return None
        loader = self._loader(trainer)
        batch = next(iter(loader)) if loader is not None else None
        before = self._measure(pl_module, batch)
        calibration = None
        if self.mode == "int8_static":
            if loader is None:
                raise ValueError("mode='int8_static' calibrates on validation (or training) batches; no loader is attached.")
            assert self.module_name is not None
            calibration = _ptq_static.calibration_calls(pl_module, self.module_name, loader, self.calibration_batches)
        result = None
        chosen = candidates
        units = self._units(pl_module, candidates)  # a tied group is one candidate of the search
        if self.monitor is not None and self.tolerance is not None:
            if loader is None:
                raise ValueError(f"`monitor`={self.monitor!r} needs a validation loader to evaluate on; none is attached.")
            result = search_float_fallback(
                list(units),
                lambda names: self._evaluate(trainer, pl_module, loader, _expand(units, names), calibration),
                tolerance=self.tolerance,
                higher_is_better=self.monitor_mode == "max",
            )
            before["metric"] = result.baseline
            if not result.met:
                drops = ", ".join(f"{n}: {d:.4g}" for n, d in result.sensitivity.items())
                warnings.warn(
                    f"PostTrainingQuantization: no configuration keeps {self.monitor!r} within tolerance "
                    f"{self.tolerance} of {result.baseline:.4g} (per-layer drops: {drops}); the model is left in float.",
                    LowMemWarning,
                    stacklevel=2,
                )
                self.summary = {"met": False, "before": before, "after": None, "kept_float": candidates}
                rank_zero_info(self._table(before, None, candidates))
                return None
            chosen = _expand(units, result.quantized)
        if self.mode == "int8_static":
            report = self._quantize_static(pl_module, chosen, calibration)
            self._set_child(pl_module, report.module)
        else:
            report = quantize_(
                pl_module, self.mode, filter_fn=lambda _, fqn: fqn in chosen, group_size=self.group_size, embeddings=self.embeddings
            )
        self.quantized = sorted(set(self.quantized) | set(report.converted))
        self.conv1d = sorted(set(self.conv1d) | set(report.conv1d))
        self.tied = [list(group) for group in report.tied]
        after = self._measure(pl_module, batch)
        if result is not None:
            after["metric"] = result.metric
        kept = [name for name in candidates if name not in chosen]
        self.summary = {"met": True, "before": before, "after": after, "kept_float": kept, "report": report}
        rank_zero_info(report.summary())
        rank_zero_info(self._table(before, after, kept))
        if trainer.logger is not None:
            trainer.logger.log_metrics(
                {"lowmem/quantization/size_ratio": before["bytes"] / max(1, after["bytes"]),
                 "lowmem/quantization/kept_float": float(len(kept)),
                 "lowmem/quantization/converted_share": report.converted_share},
                step=trainer.global_step,
            )  # fmt: skip
        return report

    def _loader(self, trainer: L.Trainer) -> Any:
        for loader in (trainer.val_dataloaders, trainer.train_dataloader):
            if isinstance(loader, (list, tuple)):
                loader = loader[0] if loader else None
            if loader is not None:
                return loader
        return None

    def _measure(self, pl_module: L.LightningModule, batch: Any) -> dict[str, Any]:
        """Size, and the latency of running the model on ``batch`` the way the package always calls it."""
        figures: dict[str, Any] = {"bytes": state_bytes(pl_module)["parameters"], "latency_s": float("nan")}
        if batch is None or not self._time_latency:
            return figures
        was_training = pl_module.training
        pl_module.eval()
        try:
            batch = move_data_to_device(batch, _ptq_static.device_of(pl_module))
            run = functools.partial(forward_batch, pl_module)
            figures["latency_s"] = measure_latency(run, (batch,), repeats=self.latency_batches, warmup=2)
        except BatchCallError as err:
            self._skip_latency(err)
        finally:
            pl_module.train(was_training)
        return figures

    # --- which layers: in-place candidates, tied groups as one unit; int8_static: the child's Linear/Conv --

    def _units(self, pl_module: L.LightningModule, candidates: list[str]) -> dict[str, list[str]]:
        """Search unit (first layer of a tied group, or the layer) -> the layers it stands for."""
        group_of = {name: group for group in tied_groups(pl_module) for name in group}
        units: dict[str, list[str]] = {}
        seen: set[str] = set()
        for name in candidates:
            if name not in seen:
                units[name] = [n for n in group_of.get(name, [name]) if n in candidates]
                seen.update(units[name])
        return units

    def _set_child(self, pl_module: L.LightningModule, child: nn.Module) -> nn.Module:
        """Install ``child`` as the submodule ``module_name``; returns the one it replaced."""
        assert self.module_name is not None
        return set_submodule(pl_module, self.module_name, child)

    def _candidates(self, pl_module: L.LightningModule, skip: bool = True) -> list[str]:
        skip_modules, filter_fn = (self.skip_modules, self.filter_fn) if skip else ((), None)
        if self.mode == "int8_static":
            assert self.module_name is not None
            return _ptq_static.static_candidates(pl_module, self.module_name, skip_modules, filter_fn)
        return quantizable_layers(
            pl_module, self.mode, filter_fn=filter_fn, skip_modules=skip_modules, group_size=self.group_size,
            embeddings=self.embeddings,
        )  # fmt: skip

    def _quantize_static(
        self, pl_module: L.LightningModule, names: Sequence[str], calibration: list[Any], *, compile: bool | None = None
    ) -> QuantizationReport:
        assert self.module_name is not None
        compile = self.compile if compile is None else compile
        evaluated, self._last_static = self._last_static, None
        if evaluated is not None and evaluated[0] == tuple(names):  # the search already built it: no second export
            report = evaluated[1]
            if compile:
                from lightning_lowmem.functional.quantization.compile import compile_inference

                report.module = compile_inference(report.module)
            return report
        return _ptq_static.quantize_child(pl_module, self.module_name, names, calibration, compile=compile)

    @contextmanager
    def _quantized_for_evaluation(self, pl_module: L.LightningModule, names: Sequence[str], calibration: list[Any] | None) -> Iterator[None]:
        """``pl_module`` with exactly ``names`` quantized inside the block; float again after it (the same
        layer objects and weight Parameters: Conv1D layers and ties come back as they were)."""
        if self.mode == "int8_static":
            if not names:
                yield
                return
            assert calibration is not None
            report = self._quantize_static(pl_module, names, calibration, compile=False)
            self._last_static = (tuple(names), report)
            previous = self._set_child(pl_module, report.module)
            try:
                yield
            finally:
                self._set_child(pl_module, previous)
            return
        originals = {name: (pl_module.get_submodule(name), pl_module.get_submodule(name).weight) for name in names}
        _quantize_layers(pl_module, self.mode, list(names), group_size=self.group_size)
        try:
            yield
        finally:
            for name, (layer, weight) in originals.items():
                if pl_module.get_submodule(name) is not layer:
                    set_submodule(pl_module, name, layer)  # the Conv1D an nn.Linear stood in for
                layer.weight = weight
                layer.__dict__.pop("extra_repr", None)  # torchao patches the instance's extra_repr

    def _evaluate(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loader: Any, names: Sequence[str], calibration: Any
    ) -> float:
        """``monitor`` of ``pl_module`` with exactly ``names`` quantized; the float weights come back after."""
        with self._quantized_for_evaluation(pl_module, names, calibration):
            accelerator = "gpu" if _ptq_static.device_of(pl_module).type == "cuda" else "cpu"
            evaluator = L.Trainer(
                accelerator=accelerator, devices=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, callbacks=[],
                limit_val_batches=trainer.limit_val_batches,  # the user's own validation budget
            )  # fmt: skip
            results = evaluator.validate(pl_module, dataloaders=loader, verbose=False)
        pl_module.trainer = trainer
        metrics = results[0] if results else {}
        if self.monitor not in metrics:
            raise ValueError(
                f"`monitor`={self.monitor!r} was never logged during validation; logged metrics: {sorted(metrics)}. "
                "Log it in validation_step with self.log(...)."
            )
        return float(metrics[self.monitor])

    def _table(self, before: dict[str, Any], after: dict[str, Any] | None, kept: list[str]) -> str:
        rows = [f"PostTrainingQuantization ({self.mode})", f"{'':10} {'size':>12} {'latency/batch':>14} {'metric':>10}"]
        for label, figures in (("float", before), ("quantized", after)):
            if figures is None:
                rows.append(f"{label:10} {'(not applied: tolerance not met)':>38}")
                continue
            metric, latency = figures.get("metric"), figures["latency_s"]
            rows.append(
                f"{label:10} {format_bytes(figures['bytes']):>12} "
                f"{(f'{latency * 1e3:.3f} ms' if latency == latency else '-'):>14} "  # nan: not timed
                f"{(f'{metric:.4f}' if metric is not None else '-'):>10}"
            )
        rows.append(f"layers kept in float: {kept or 'none'}")
        slower = after is not None and after["latency_s"] > before["latency_s"]  # nan compares False
        if slower:
            rows.append(
                f"note: quantized runs {after['latency_s'] / before['latency_s']:.1f}x SLOWER than float here: eager torchao "
                "int8 dispatches per op (smaller, not faster); on CPU use mode='int8_static' with compile=True for speed"
            )
        return "\n".join(rows)
