"""`MemoryMonitor`: where training memory goes, logged per step and summarised at fit end."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from typing_extensions import override

from lightning_lowmem._compat.cuda_memory import cuda_dump_snapshot, cuda_record_memory_history
from lightning_lowmem.memory import MemoryReport, track_memory
from lightning_lowmem.memory.monitoring import (
    cheap_figures,
    check_intervals,
    compiled_optimizer_steps,
    compiled_step_warning,
    is_deep_step,
    report_figures,
    summary_table,
    with_all_ranks,
)
from lightning_lowmem.callbacks._technique_base import TechniqueCallback
from lightning_lowmem.warnings import LowMemWarning

PREFIX = "lowmem/memory"


class MemoryMonitor(TechniqueCallback):
    """Log memory figures during training and print a breakdown table when ``fit`` ends.

    Two depths:

    * **cheap**, every ``log_every_n_steps``: CUDA allocator figures (``allocated``, ``max_allocated``,
      ``reserved``, ``fragmentation`` = reserved - allocated) or, on CPU, process ``rss`` plus the
      bytes of parameters, gradients and optimizer state (a walk over known tensors, no tracking).
    * **deep**, on sampled steps: the whole training step (forward, backward, optimizer step) runs
      under the memory core's tracker, which logs the peak and its breakdown (``parameters``,
      ``gradients``, ``optimizer_state``, ``activations``, ``other``). This costs Python time per op,
      so it is sampled: the second training step (the first with optimizer state) and then every
      ``deep_every_n_steps``. A tracker cannot see inside a compiled graph, so ``torch.compile``-d code
      (e.g. torchao's 8-bit / 4-bit AdamW step) runs eagerly during a deep step; its eager temporaries
      can exceed the compiled ones, so read that step's optimizer peak as an upper bound
      (docs/composition.md; a ``LowMemWarning`` says so once, at the first such deep step). Other steps run
      compiled, as without the monitor.

    Keys are logged under ``lowmem/memory/...`` to every logger of the Trainer, at the step they were
    measured (as Lightning's ``LearningRateMonitor`` does). On several processes (DDP, FSDP) each rank
    measures its own step; the figures are gathered so that ``<key>_max`` (e.g. ``lowmem/memory/peak_max``)
    is the largest rank's and ``rank<r>/peak`` (also ``max_allocated`` / ``rss``) each rank's, next to
    the logging rank's own ``<key>``. ``pl_module.log`` is not used because it
    repeats a callback's last value on every later step, which would show a deep measurement on steps
    that never had one.

    Args:
        log_every_n_steps: cheap figures every this many steps. Default: ``None`` = the Trainer's
            ``log_every_n_steps``.
        deep_every_n_steps: deep breakdown every this many steps (besides the second step);
            ``0`` disables deep steps entirely. Default: ``None`` = only the second step.
        snapshot_on_oom: on CUDA, record allocator history and write a snapshot file (open it at
            pytorch.org/memory_viz) when a CUDA out-of-memory error escapes ``fit``. Default: ``False``.
        snapshot_path: where the snapshot goes. Default: ``<log_dir>/memory_snapshot_oom.pickle``.
        summary: print a Rich table at fit end on rank zero. Default: ``True``.

    Raises:
        ValueError: a step interval is not a positive integer.

    Example::

        >>> from lightning_lowmem.demo import DigitsClassifier, DigitsDataModule
        >>> monitor = MemoryMonitor(log_every_n_steps=1, summary=False)
        >>> trainer = L.Trainer(max_steps=2, callbacks=[monitor], logger=False, enable_progress_bar=False,
        ...                     enable_checkpointing=False, enable_model_summary=False)
        >>> trainer.fit(DigitsClassifier(hidden=32), DigitsDataModule())
        >>> monitor.last_report.breakdown["optimizer_state"] > 0
        True
    """

    tags = frozenset({"monitor"})  # technique: None, it only measures

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        deep_every_n_steps: int | None = None,
        snapshot_on_oom: bool = False,
        snapshot_path: str | None = None,
        summary: bool = True,
    ) -> None:
        super().__init__()
        check_intervals(log_every_n_steps, deep_every_n_steps)
        self.log_every_n_steps = log_every_n_steps
        self.deep_every_n_steps = deep_every_n_steps
        self.snapshot_on_oom = snapshot_on_oom
        self.snapshot_path = snapshot_path
        self.summary = summary
        self.history: list[dict[str, float]] = []
        self.last_report: MemoryReport | None = None
        self._deep: contextlib.ExitStack | None = None
        self._tracking: Any = None
        self._pending_report: MemoryReport | None = None
        self._step_hooks: list[Any] = []
        self._tracked_optimizer: Any = None
        self._recording = False
        self._device = "cpu"
        self._batch_step = 0
        self._warned_compiled = False

    # ------------------------------------------------------------------ setup / teardown
    @override
    def setup_technique(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._device = trainer.strategy.root_device.type
        if self.snapshot_on_oom:
            if self._device == "cuda":
                cuda_record_memory_history(True)
                self._recording = True
            else:
                rank_zero_warn(f"MemoryMonitor(snapshot_on_oom=True) needs CUDA; this run is on {self._device!r}.")

    @override
    def release(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_deep()
        self._remove_step_hooks()
        if self._recording:
            cuda_record_memory_history(False)
            self._recording = False

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)  # a failed setup: every technique's change undone
        self._stop_deep()
        self._remove_step_hooks()
        if self._recording and isinstance(exception, torch.OutOfMemoryError):
            path = self.snapshot_path or os.path.join(
                trainer.log_dir or trainer.default_root_dir, "memory_snapshot_oom.pickle"
            )
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            cuda_dump_snapshot(path)
            rank_zero_warn(f"CUDA out of memory: allocator snapshot written to {path} (view at pytorch.org/memory_viz)")

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_step = trainer.global_step
        if (
            trainer.sanity_checking
            or not is_deep_step(trainer.global_step, self.deep_every_n_steps)
            or self._deep is not None
        ):
            return
        if not pl_module.automatic_optimization:  # the user steps inside training_step: track the whole batch
            self._start_deep(pl_module, trainer.optimizers)
            return
        # Automatic optimization runs forward, backward and the step inside `optimizer.step(closure)`: track
        # exactly that call. Other callbacks' per-batch work (e.g. ActivationCompression's hooks, entered
        # in their own `on_train_batch_start`) then surrounds the measurement wherever they stand in the
        # callback list, so the step is measured as it runs. A batch that only accumulates never steps.
        optimizers = list(trainer.optimizers)

        def start(optimizer: Any, args: Any, kwargs: Any) -> None:
            if self._deep is None and any(optimizer is o for o in optimizers):
                self._start_deep(pl_module, optimizers)
                self._tracked_optimizer = optimizer

        def stop(optimizer: Any, args: Any, kwargs: Any) -> None:
            if self._tracking is not None and optimizer is self._tracked_optimizer:
                # the report is built at batch end: hooks cannot be removed while torch runs them
                self._tracking.tracker.stop()

        self._step_hooks = [register_optimizer_step_pre_hook(start), register_optimizer_step_post_hook(stop)]

    def _start_deep(self, pl_module: L.LightningModule, optimizers: Any) -> None:
        compiled = compiled_optimizer_steps(list(optimizers))
        if compiled and not self._warned_compiled:  # once: the deep steps that follow run it the same way
            self._warned_compiled = True
            rank_zero_warn(compiled_step_warning(compiled, self._batch_step), category=LowMemWarning)
        self._deep = contextlib.ExitStack()
        self._tracking = self._deep.enter_context(
            track_memory(pl_module, list(optimizers), device=self._device, by_module=False)
        )

    def _finish_deep(self) -> None:
        self._stop_deep()
        if self._tracking is not None:
            self._pending_report = self._tracking.report
            self._tracking = None

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self._batch_step
        record: dict[str, float] = {}
        self._finish_deep()
        self._remove_step_hooks()
        if self._pending_report is not None:
            report, self._pending_report = self._pending_report, None
            self.last_report = report
            record.update(report_figures(report))
        every = self.log_every_n_steps or trainer.log_every_n_steps or 1
        if record or step % every == 0:
            record.update(cheap_figures(self._device, pl_module, trainer.optimizers))
        if trainer.world_size > 1:  # a collective: every rank has a record at the same steps
            record = with_all_ranks(record, trainer.strategy.all_gather, trainer.world_size, pl_module.device)
        if record:
            metrics = {f"{PREFIX}/{key}": float(value) for key, value in record.items()}
            record["step"] = step
            self.history.append(record)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _stop_deep(self) -> None:
        if self._deep is not None:
            deep, self._deep = self._deep, None
            deep.close()

    def _remove_step_hooks(self) -> None:
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []
        self._tracked_optimizer = None

    # ------------------------------------------------------------------ summary
    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.summary:
            self._print_summary()

    @rank_zero_only
    def _print_summary(self) -> None:
        from rich.console import Console

        table = self.summary_table()
        if table is None:
            rank_zero_info("MemoryMonitor: no step was measured.")
            return
        Console().print(table)

    def summary_table(self) -> Any:
        """A Rich table of the last deep breakdown and the largest cheap figures, or ``None``."""
        return summary_table(self.history, self.last_report, self._device)

    # ------------------------------------------------------------------ resume
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.history),
            "last_report": self.last_report.to_dict() if self.last_report is not None else None,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        last = state_dict.get("last_report")
        self.last_report = MemoryReport(**last) if last else None
