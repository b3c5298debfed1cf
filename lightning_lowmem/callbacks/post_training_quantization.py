"""`PostTrainingQuantization`: quantize at the end of ``fit``, optionally within an accuracy tolerance."""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_lowmem.callbacks import _quantized_checkpoints
from lightning_lowmem.callbacks._quantized_checkpoints import (  # re-exported: the documented import path
    CHECKPOINT_KEY,
    load_quantized_checkpoint,
    quantize_like_checkpoint,
)
from lightning_lowmem.functional.quantization import (
    MODES,
    QuantizationReport,
    _include_embeddings,
    _quantize_layers,
    measure_latency,
    quantizable_layers,
    quantize_,
    search_float_fallback,
)
from lightning_lowmem.memory.measure import state_bytes
from lightning_lowmem.memory.units import format_bytes
from lightning_lowmem.warnings import LowMemWarning, NoEffectWarning

__all__ = ["PostTrainingQuantization", "load_quantized_checkpoint", "quantize_like_checkpoint"]

_STATIC_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d)


def _is_quantized(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and type(tensor) not in (torch.Tensor, nn.Parameter)


def _first_input(batch: Any) -> tuple[Any, ...]:
    return (batch[0],) if isinstance(batch, (tuple, list)) else (batch,)


def _device(module: nn.Module) -> torch.device:
    """Where ``module`` lives (an exported int8 graph may hold its weights as buffers only)."""
    tensor = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


class PostTrainingQuantization(L.Callback):
    """Quantize the model's ``nn.Linear`` layers and ``nn.Embedding`` tables with torchao at the end of ``fit``.

    With ``monitor`` and ``tolerance``, the quantized model is evaluated on the validation loader;
    while the drop of ``monitor`` exceeds ``tolerance``, the layers whose quantization alone hurts
    the metric most (measured, one evaluation per layer) are kept in float. If no mix meets the
    tolerance the model is left entirely in float (never half-converted). A before/after table (size,
    CPU latency per batch, metric, layers kept in float) is printed and kept in :attr:`summary`.

    ``mode="int8_static"`` (the fast CPU path) replaces the child module ``module_name`` (e.g. the
    ``model`` a LightningModule's ``forward`` calls) by its pt2e int8 graph, calibrated on the inputs
    that child receives during ``calibration_batches`` validation batches; with ``compile=True`` the
    graph is wrapped in :class:`~lightning_lowmem.functional.quantization_compile.CompiledInference`
    (oneDNN int8 kernels, inference only). Later ``validate``/``test``/``predict`` use it.

    Checkpoints: the quantized weights are saved as torchao tensors. When the same callback is in a
    Trainer that loads such a checkpoint (``fit/validate/test(ckpt_path=...)``), it quantizes the
    matching layers before the weights load (and, while a stage runs, has Lightning's plain
    ``TorchCheckpointIO`` load with ``map_location="cpu"``: torch cannot rebuild torchao tensors through
    Lightning's callable one). Without a Trainer use :func:`load_quantized_checkpoint`, or call
    :func:`quantize_like_checkpoint` in ``on_load_checkpoint`` for ``load_from_checkpoint``.
    An ``int8_static`` model is for inference in this process: keep the float checkpoint to reload.

    Args:
        mode: ``"int8_dynamic"``, ``"int8_weight_only"``, ``"int4_weight_only"`` (CUDA),
            ``"intx4_weight_only"`` or ``"int8_static"`` (needs ``module_name``). Default: ``"int8_dynamic"``.
        skip_modules: names of submodules kept in float. Default: ``()``.
        filter_fn: ``filter_fn(layer, fqn) -> bool``; not YAML-serialisable, prefer ``skip_modules``
            in configs. Default: ``None``.
        embeddings: quantize ``nn.Embedding`` tables too (weight-only: int8 per row, int4 values in
            groups for the int4 modes). Default: ``None``: yes, except with ``int8_static`` (which
            leaves them float; ``True`` there raises).
        monitor: a metric logged in ``validation_step`` (e.g. ``"val_acc"``). Default: ``None``.
        tolerance: largest allowed drop of ``monitor`` (in its units). Needs ``monitor``. Default: ``None``.
        monitor_mode: ``"max"`` if higher ``monitor`` is better, ``"min"`` otherwise. Default: ``"max"``.
        group_size: group length of the int4 modes. Default: ``32``.
        latency_batches: batches timed for the latency column (``0`` disables). Default: ``10``.
        module_name: ``int8_static`` only: the submodule replaced by its int8 graph. Default: ``None``.
        calibration_batches: ``int8_static`` only: validation batches run to calibrate. Default: ``8``.
        compile: ``int8_static`` only: compile the int8 graph for inference (oneDNN kernels; the first
            call of each input shape compiles). Default: ``False``.

    Raises:
        ValueError: unknown ``mode`` / ``monitor_mode``, ``tolerance`` without ``monitor`` or < 0,
            ``int8_static`` without ``module_name`` or with ``embeddings=True``, ``module_name`` /
            ``compile`` with another mode.
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
                "lightning_lowmem.functional.quantization_compile.compile_inference(model)."
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
        self.summary: dict[str, Any] = {}
        self._hook_handle: Any = None
        self._replaced_io: Any = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.mode)

    # --- checkpoints -----------------------------------------------------------------------------------

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.module_name is not None:
            try:
                pl_module.get_submodule(self.module_name)
            except AttributeError:
                children = [name for name, _ in pl_module.named_children()]
                raise ValueError(
                    f"`module_name`={self.module_name!r} is not a submodule of {type(pl_module).__name__}; "
                    f"its children are {children}."
                ) from None
        if self._hook_handle is None:
            self._hook_handle = pl_module.register_load_state_dict_pre_hook(self._quantize_before_load)
        if self._replaced_io is None:  # so that `ckpt_path=` may hold quantized tensors
            self._replaced_io = _quantized_checkpoints.swap_in(trainer)

    def _quantize_before_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Quantize the layers whose incoming weights are torchao tensors, so they load in place."""
        if self.mode == "int8_static":
            return  # an exported graph has other state names; it is never rebuilt from a checkpoint
        names = [
            fqn
            for fqn in quantizable_layers(module, self.mode, group_size=self.group_size, embeddings=True)
            if _is_quantized(state_dict.get(f"{prefix}{fqn}.weight"))
        ]
        if names:
            _quantize_layers(module, self.mode, names, group_size=self.group_size)
            self.quantized = sorted(set(self.quantized) | set(names))
        _quantized_checkpoints.match_zero_points(module, state_dict, prefix)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None
        _quantized_checkpoints.swap_back(trainer, self._replaced_io)
        self._replaced_io = None

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.quantized:
            checkpoint[CHECKPOINT_KEY] = {"mode": self.mode, "group_size": self.group_size, "quantized": self.quantized}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "group_size": self.group_size, "quantized": list(self.quantized)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.quantized = list(state_dict.get("quantized", []))

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
                    f"PostTrainingQuantization(mode={self.mode!r}) found no quantizable nn.Linear / nn.Embedding layer in "
                    f"{type(pl_module).__name__}: the model stays in float.",
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
            calibration = self._calibration_inputs(pl_module, loader)
        result = None
        chosen = candidates
        if self.monitor is not None and self.tolerance is not None:
            if loader is None:
                raise ValueError(f"`monitor`={self.monitor!r} needs a validation loader to evaluate on; none is attached.")
            result = search_float_fallback(
                candidates,
                lambda names: self._evaluate(trainer, pl_module, loader, names, calibration),
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
            chosen = result.quantized
        if self.mode == "int8_static":
            report = self._quantize_static(pl_module, chosen, calibration)
            self._set_child(pl_module, report.module)
        else:
            report = quantize_(
                pl_module, self.mode, filter_fn=lambda _, fqn: fqn in chosen, group_size=self.group_size, embeddings=self.embeddings
            )
        self.quantized = sorted(set(self.quantized) | set(report.converted))
        after = self._measure(pl_module, batch)
        if result is not None:
            after["metric"] = result.metric
        kept = [name for name in candidates if name not in chosen]
        self.summary = {"met": True, "before": before, "after": after, "kept_float": kept, "report": report}
        rank_zero_info(self._table(before, after, kept))
        if trainer.logger is not None:
            trainer.logger.log_metrics(
                {"lowmem/quantization/size_ratio": before["bytes"] / max(1, after["bytes"]),
                 "lowmem/quantization/kept_float": float(len(kept))},
                step=trainer.global_step,
            )
        return report

    def _loader(self, trainer: L.Trainer) -> Any:
        for loader in (trainer.val_dataloaders, trainer.train_dataloader):
            if isinstance(loader, (list, tuple)):
                loader = loader[0] if loader else None
            if loader is not None:
                return loader
        return None

    def _measure(self, pl_module: L.LightningModule, batch: Any) -> dict[str, Any]:
        figures: dict[str, Any] = {"bytes": state_bytes(pl_module)["parameters"], "latency_s": float("nan")}
        if batch is not None and self.latency_batches > 0:
            was_training = pl_module.training
            pl_module.eval()
            device = _device(pl_module)
            inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in _first_input(batch))
            figures["latency_s"] = measure_latency(pl_module, inputs, repeats=self.latency_batches, warmup=2)
            pl_module.train(was_training)
        return figures

    # --- int8_static: replace the child ``module_name`` by its exported int8 graph ----------------------

    def _candidates(self, pl_module: L.LightningModule) -> list[str]:
        if self.mode != "int8_static":
            return quantizable_layers(
                pl_module, self.mode, filter_fn=self.filter_fn, skip_modules=self.skip_modules, group_size=self.group_size,
                embeddings=self.embeddings,
            )  # fmt: skip
        assert self.module_name is not None
        skip = tuple(self.skip_modules)
        names = []
        for fqn, layer in pl_module.get_submodule(self.module_name).named_modules(prefix=self.module_name):
            if not isinstance(layer, _STATIC_TYPES) or any(fqn == s or fqn.startswith(s + ".") for s in skip):
                continue
            if self.filter_fn is None or self.filter_fn(layer, fqn):
                names.append(fqn)
        return names

    def _calibration_inputs(self, pl_module: L.LightningModule, loader: Any) -> list[tuple[Any, ...]]:
        """The positional inputs the child ``module_name`` receives on the first validation batches."""
        assert self.module_name is not None
        captured: list[tuple[Any, ...]] = []

        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if kwargs:
                raise ValueError(
                    f"`module_name`={self.module_name!r} is called with keyword arguments {sorted(kwargs)}; "
                    "int8_static exports positional inputs only."
                )
            captured.append(tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args))

        handle = pl_module.get_submodule(self.module_name).register_forward_pre_hook(record, with_kwargs=True)
        device = _device(pl_module)
        was_training = pl_module.training
        pl_module.eval()
        try:
            with torch.no_grad():
                for index, batch in enumerate(loader):
                    if index >= self.calibration_batches:
                        break
                    pl_module(*(x.to(device) if isinstance(x, torch.Tensor) else x for x in _first_input(batch)))
        finally:
            handle.remove()
            pl_module.train(was_training)
        return captured

    def _quantize_static(
        self, pl_module: L.LightningModule, names: Sequence[str], calibration: list[tuple[Any, ...]], *, compile: bool | None = None
    ) -> QuantizationReport:
        """Static int8 of a copy of the child with exactly ``names`` quantized (``report.module``: to install)."""
        from lightning_lowmem.functional.quantization_compile import compile_inference
        from lightning_lowmem.functional.quantization_static import quantize_static

        prefix = f"{self.module_name}."
        chosen = {name.removeprefix(prefix) for name in names}
        child = copy.deepcopy(pl_module.get_submodule(self.module_name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NoEffectWarning)  # evaluating "none quantized" is expected
            report = quantize_static(child, calibration[0], calibration, filter_fn=lambda _, fqn: fqn in chosen)
        report.converted = [prefix + name for name in report.converted]
        if self.compile if compile is None else compile:
            report.module = compile_inference(report.module)
        return report

    def _set_child(self, pl_module: L.LightningModule, child: nn.Module) -> nn.Module:
        """Install ``child`` as the submodule ``module_name``; returns the one it replaced."""
        assert self.module_name is not None
        parent_name, _, attribute = self.module_name.rpartition(".")
        parent = pl_module.get_submodule(parent_name)
        previous = getattr(parent, attribute)
        setattr(parent, attribute, child)
        return previous

    @contextmanager
    def _quantized_for_evaluation(
        self, pl_module: L.LightningModule, names: Sequence[str], calibration: list[tuple[Any, ...]] | None
    ) -> Iterator[None]:
        """``pl_module`` with exactly ``names`` quantized inside the block; float again after it."""
        if self.mode == "int8_static":
            if not names:
                yield
                return
            assert calibration is not None
            report = self._quantize_static(pl_module, names, calibration, compile=False)
            previous = self._set_child(pl_module, report.module)
            try:
                yield
            finally:
                self._set_child(pl_module, previous)
            return
        originals = {name: pl_module.get_submodule(name).weight for name in names}
        _quantize_layers(pl_module, self.mode, list(names), group_size=self.group_size)
        try:
            yield
        finally:
            for name, weight in originals.items():
                layer = pl_module.get_submodule(name)
                layer.weight = weight
                layer.__dict__.pop("extra_repr", None)  # torchao patches the instance's extra_repr

    def _evaluate(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loader: Any, names: Sequence[str], calibration: Any
    ) -> float:
        """``monitor`` of ``pl_module`` with exactly ``names`` quantized; the float weights come back after."""
        with self._quantized_for_evaluation(pl_module, names, calibration):
            accelerator = "gpu" if _device(pl_module).type == "cuda" else "cpu"
            evaluator = L.Trainer(
                accelerator=accelerator, devices=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, callbacks=[],
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
        return "\n".join(rows)
