"""`PostTrainingQuantization`: quantize at the end of ``fit``, optionally within an accuracy tolerance."""

from __future__ import annotations

import warnings
from typing import Any, Callable, ContextManager, Sequence

import lightning as L
from lightning.pytorch.utilities import move_data_to_device, rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_lowmem.callbacks._quantization_base import QuantizationCallback
from lightning_lowmem.checkpoints.quantized import (  # re-exported: the documented import path
    load_quantized_checkpoint,
    quantized_checkpoint_path,
    quantize_like_checkpoint,
)
from lightning_lowmem.functional.config.constants import GROUP_SIZE
from lightning_lowmem.functional.quantization.arguments import check_ptq_arguments, check_submodule
from lightning_lowmem.functional.quantization.calibration import StaticChild, device_of
from lightning_lowmem.functional.quantization.layers import check_patterns, tied_groups
from lightning_lowmem.functional.quantization.ptq import (
    QuantizationReport,
    unsupported_reason,
    quantizable_layers,
    quantize_,
    temporarily_quantized,
)
from lightning_lowmem.functional.quantization.report import comparison_table, logged_metrics, tolerance_failure_message
from lightning_lowmem.functional.quantization.search import size_and_latency
from lightning_lowmem.functional.quantization.tolerance import (
    ToleranceReport,
    quantize_within_tolerance,
    search_layers_within_tolerance,
)
from lightning_lowmem.model_io import BatchCallError, has_forward_batch, model_inputs
from lightning_lowmem.warnings import LowMemWarning, NoEffectWarning

__all__ = ["PostTrainingQuantization", "load_quantized_checkpoint", "quantize_like_checkpoint"]


class PostTrainingQuantization(QuantizationCallback):
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

    With ``monitor`` alone, the metric is measured on the validation loader before and after quantizing and the
    change is reported (the table's *metric* column, :attr:`summary`); every layer is quantized.
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
    With a ``ModelCheckpoint`` (Lightning's default), the quantized model is saved after quantizing to
    ``<its dirpath>/quantized.ckpt`` (weights only; :attr:`saved_path`), since the checkpoints written during
    ``fit`` hold the float model: ``load_quantized_checkpoint(MyModule, trainer.checkpoint_callback.dirpath +
    "/quantized.ckpt")``.

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
        monitor: a metric logged in ``validation_step`` (e.g. ``"val_acc"``), measured before and after
            quantizing (without ``tolerance``: reported only). Default: ``None``.
        tolerance: largest allowed drop of ``monitor`` (in its units). Needs ``monitor``. Default: ``None``.
        monitor_mode: ``"max"`` if higher ``monitor`` is better, ``"min"`` otherwise. Default: ``"max"``.
        group_size: group length of the int4 modes. Default: ``GROUP_SIZE`` (32).
        latency_batches: times the first validation batch is run for the latency column (``0`` disables).
            On CPU, eager torchao int8 is *slower* than float (the table says so); the fast path is
            ``int8_static`` with ``compile=True``. Default: ``10``.
        module_name: ``int8_static`` only: the submodule replaced by its int8 graph. Default: ``None``.
        calibration_batches: ``int8_static`` only: validation batches run to calibrate. Default: ``8``.
        compile: ``int8_static`` only: compile the int8 graph for inference (oneDNN kernels; the first
            call of each input shape compiles). Default: ``False``.

    Override points: :meth:`quantize` (the whole conversion; callable on demand, e.g. before ``test``),
    :meth:`validation_metric` (the metric of the model as it is, the ``evaluate`` the tolerance search is
    given; default: your ``validation_step`` in a throw-away Trainer), :meth:`evaluate` (``int8_static``: the
    metric with exactly some layers in the int8 graph), :meth:`measure` (the size / latency columns). The
    callback decides *when*; the tolerance search is the functional workflow
    :func:`~lightning_lowmem.functional.quantization.tolerance.quantize_within_tolerance`, and the transforms
    live in :mod:`lightning_lowmem.functional.quantization` (``ptq``, ``calibration``, ``search``, ``report``);
    checkpoint loading goes through the state-dict matcher shared with ``QuantizationAwareTraining``.

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

    tags = frozenset({"ptq"})  # technique: None, it acts after training

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
        group_size: int = GROUP_SIZE,
        latency_batches: int = 10,
        module_name: str | None = None,
        calibration_batches: int = 8,
        compile: bool = False,
    ) -> None:
        self.config = check_ptq_arguments(  # the mode and group_size as a QuantizationConfig, checked once
            mode,
            skip_modules=skip_modules,
            embeddings=embeddings,
            monitor=monitor,
            tolerance=tolerance,
            monitor_mode=monitor_mode,
            module_name=module_name,
            calibration_batches=calibration_batches,
            compile=compile,
            group_size=group_size,
        )
        super().__init__(mode)
        self.skip_modules = list(skip_modules)
        self.filter_fn, self.embeddings, self.group_size = filter_fn, embeddings, group_size
        self.monitor, self.tolerance, self.monitor_mode = monitor, tolerance, monitor_mode
        self.latency_batches, self.module_name = latency_batches, module_name
        self.calibration_batches, self.compile = calibration_batches, compile
        self.quantized: list[str] = []
        self.tied: list[list[str]] = []
        self.summary: dict[str, Any] = {}
        self.saved_path: str | None = None  # where on_fit_end saved the quantized model (a ModelCheckpoint folder)
        self._call_checked = False
        self._time_latency = latency_batches > 0
        self._static = StaticChild(module_name, compile) if module_name is not None else None

    @override
    def setup_technique(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device.type
        reason = unsupported_reason(self.mode, device)
        if reason is not None:  # now, not after the whole fit
            raise ValueError(f"`mode`={self.mode!r} cannot run on this Trainer's device {device!r}: {reason}")
        if self.module_name is not None:
            check_submodule(pl_module, self.module_name)
        if not self.quantized:  # names of the float model (an int8_static child is a graph afterwards)
            check_patterns(pl_module, self.skip_modules, "skip_modules", self._candidates(pl_module, skip=False))
        self.attach_load_hooks(trainer, pl_module)  # so that `ckpt_path=` may hold quantized weights

    @override
    def on_quantized_weights_loaded(self, module: nn.Module, names: list[str]) -> None:
        self.quantized = sorted(set(self.quantized) | set(names))
        self.tied = [group for group in tied_groups(module) if set(group) <= set(self.quantized)]

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.quantized:
            self.record_checkpoint(checkpoint, self.state_dict(), instruct=self.mode == "int8_static")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "group_size": self.group_size,
            "quantized": list(self.quantized),
            "conv1d": list(self.conv1d),
            "tied": [list(group) for group in self.tied],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.quantized = list(state_dict.get("quantized", []))
        self.conv1d = list(state_dict.get("conv1d", []))
        self.tied = [list(group) for group in state_dict.get("tied", [])]

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._call_checked:  # at the first batch, not after the whole fit
            self._call_checked = True
            self._check_batch_call(pl_module, batch)

    def _check_batch_call(self, pl_module: L.LightningModule, batch: Any) -> None:
        """Whether the package can call the model on a batch like this one (signature only, no forward)."""
        if has_forward_batch(pl_module) or not (self.mode == "int8_static" or self._time_latency):
            return
        from lightning_lowmem.model_io import check_signature as _check_signature

        try:
            args, kwargs = model_inputs(batch)
            _check_signature(pl_module, args, kwargs, batch)
        except BatchCallError as err:
            if self.mode == "int8_static":
                raise BatchCallError(
                    f"PostTrainingQuantization(mode='int8_static') calibrates by running the model: {err}"
                ) from None
            self._skip_latency(err)

    def _skip_latency(self, err: Exception) -> None:
        self._time_latency = False
        warnings.warn(f"PostTrainingQuantization: the latency column is not timed: {err}", LowMemWarning, stacklevel=3)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        report = self.quantize(trainer, pl_module)
        path = quantized_checkpoint_path(trainer) if report is not None and self.mode != "int8_static" else None
        if path is not None:  # the last ModelCheckpoint save came before this hook: it holds the float model
            trainer.save_checkpoint(path, weights_only=True)
            self.saved_path = path
            rank_zero_info(f"PostTrainingQuantization: quantized model saved to {path} (load_quantized_checkpoint)")

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
        before = self.measure(pl_module, batch)
        calls = None
        if self.mode == "int8_static":
            if loader is None:
                raise ValueError(
                    "mode='int8_static' calibrates on validation (or training) batches; no loader is attached."
                )
            device = device_of(pl_module)
            batches = (move_data_to_device(item, device) for item in loader)
            calls = self._static.calibrate(pl_module, batches, self.calibration_batches)
        if self.monitor is not None and self.tolerance is None:  # report the change, keep every layer quantized
            if loader is None:
                raise ValueError(
                    f"`monitor`={self.monitor!r} needs a validation loader to evaluate on; none is attached."
                )
            before["metric"] = self.evaluate(trainer, pl_module, loader, [], calls)
            measured_after = self.evaluate(trainer, pl_module, loader, candidates, calls)
        result = self._search(trainer, pl_module, loader, candidates, calls)  # None without a tolerance
        if result is not None:
            before["metric"] = result.baseline
            if not result.met:
                message = tolerance_failure_message(self.monitor, self.tolerance, result.baseline, result.sensitivity)
                warnings.warn(message, LowMemWarning, stacklevel=2)
                self.summary = {"met": False, "before": before, "after": None, "kept_float": candidates}
                rank_zero_info(comparison_table(self.mode, before, None, candidates))
                return None
        chosen = candidates if result is None else result.quantized
        if result is not None and result.report is not None:  # the in-place search converted the model already
            report = result.report
        elif self.mode == "int8_static":
            report = self._static.build(pl_module, chosen, calls)
            self._static.install(pl_module, report.module)
        else:
            report = quantize_(
                pl_module, self.config, filter_fn=lambda _, fqn: fqn in chosen, embeddings=self.embeddings
            )
        self.quantized = sorted(set(self.quantized) | set(report.converted))
        self.conv1d = sorted(set(self.conv1d) | set(report.conv1d))
        self.tied = [list(group) for group in report.tied]
        after = self.measure(pl_module, batch)
        if result is not None:
            after["metric"] = result.metric
        elif self.monitor is not None:
            after["metric"] = measured_after
            rank_zero_info(
                f"PostTrainingQuantization: {self.monitor} {before['metric']:.4g} -> {measured_after:.4g} "
                f"({measured_after - before['metric']:+.4g}; no `tolerance`: every layer quantized, none kept float)"
            )
        kept = [name for name in candidates if name not in chosen]
        self.summary = {"met": True, "before": before, "after": after, "kept_float": kept, "report": report}
        rank_zero_info(report.summary())
        rank_zero_info(comparison_table(self.mode, before, after, kept))
        if trainer.logger is not None:
            trainer.logger.log_metrics(logged_metrics(before, after, kept, report), step=trainer.global_step)
        return report

    def _search(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loader: Any, candidates: list[str], calls: Any
    ) -> ToleranceReport | None:
        """The tolerance search (``monitor`` and ``tolerance`` given): the functional workflow
        :func:`~lightning_lowmem.functional.quantization.tolerance.quantize_within_tolerance` for the in-place
        modes, which also converts; for ``int8_static`` the search alone over the calibrated graph."""
        if self.monitor is None or self.tolerance is None:
            return None
        if loader is None:
            raise ValueError(f"`monitor`={self.monitor!r} needs a validation loader to evaluate on; none is attached.")
        higher_is_better = self.monitor_mode == "max"
        if self.mode == "int8_static":
            return search_layers_within_tolerance(
                pl_module,
                candidates,
                lambda names: self.evaluate(trainer, pl_module, loader, names, calls),
                self.tolerance,
                higher_is_better=higher_is_better,
            )
        return quantize_within_tolerance(
            pl_module,
            self.config,
            lambda module: self.validation_metric(trainer, module, loader),
            self.tolerance,
            higher_is_better=higher_is_better,
            filter_fn=lambda _, fqn: fqn in set(candidates),
            embeddings=self.embeddings,
        )

    def _loader(self, trainer: L.Trainer) -> Any:
        for loader in (trainer.val_dataloaders, trainer.train_dataloader):
            if isinstance(loader, (list, tuple)):
                loader = loader[0] if loader else None
            if loader is not None:
                return loader
        return None

    def measure(self, pl_module: L.LightningModule, batch: Any) -> dict[str, Any]:
        """``{"bytes", "latency_s"}`` of ``pl_module`` run on ``batch`` (``nan``: not timed)."""
        if batch is None or not self._time_latency:
            return size_and_latency(pl_module)
        try:
            batch = move_data_to_device(batch, device_of(pl_module))
            return size_and_latency(pl_module, batch, repeats=self.latency_batches, warmup=2)
        except BatchCallError as err:
            self._skip_latency(err)
            return size_and_latency(pl_module)

    def _candidates(self, pl_module: L.LightningModule, skip: bool = True) -> list[str]:
        skip_modules, filter_fn = (self.skip_modules, self.filter_fn) if skip else ((), None)
        if self.mode == "int8_static":
            return self._static.candidates(pl_module, skip_modules, filter_fn)
        return quantizable_layers(
            pl_module,
            self.mode,
            filter_fn=filter_fn,
            skip_modules=skip_modules,
            group_size=self.group_size,
            embeddings=self.embeddings,
        )

    def _quantized_for_evaluation(
        self, pl_module: L.LightningModule, names: Sequence[str], calls: Any
    ) -> ContextManager[Any]:
        """``pl_module`` with exactly ``names`` quantized inside the block; float again after it."""
        if self.mode == "int8_static":
            return self._static.evaluating(pl_module, names, calls)
        return temporarily_quantized(pl_module, self.mode, names, group_size=self.group_size)

    def evaluate(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loader: Any, names: Sequence[str], calls: Any
    ) -> float:
        """``monitor`` of ``pl_module`` with exactly ``names`` quantized; the float weights come back after
        (the ``int8_static`` search; the in-place modes' search quantizes itself and calls
        :meth:`validation_metric`)."""
        with self._quantized_for_evaluation(pl_module, names, calls):
            return self.validation_metric(trainer, pl_module, loader)

    def validation_metric(self, trainer: L.Trainer, pl_module: L.LightningModule, loader: Any) -> float:
        """``monitor`` of ``pl_module`` as it is now: your ``validation_step`` over ``loader`` in a throw-away
        Trainer (the ``evaluate`` the tolerance search is given)."""
        accelerator = "gpu" if device_of(pl_module).type == "cuda" else "cpu"
        evaluator = L.Trainer(
            accelerator=accelerator,
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[],
            limit_val_batches=trainer.limit_val_batches,  # the user's own validation budget
        )
        results = evaluator.validate(pl_module, dataloaders=loader, verbose=False)
        pl_module.trainer = trainer
        metrics = results[0] if results else {}
        if self.monitor not in metrics:
            raise ValueError(
                f"`monitor`={self.monitor!r} was never logged during validation; logged metrics: {sorted(metrics)}. "
                "Log it in validation_step with self.log(...)."
            )
        return float(metrics[self.monitor])
