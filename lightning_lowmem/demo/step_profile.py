"""`StepMemoryProfile`: one training step measured, and the live bytes traced *within* that step."""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from lightning_lowmem.memory import MemoryReport, track_memory


class StepMemoryProfile(L.Callback):
    """Measure training step ``step`` with :func:`~lightning_lowmem.memory.track_memory` and trace it.

    The report is the step's peak with its breakdown (as ``MemoryMonitor``'s deep steps measure it).
    The trace is the live tensor bytes after every module forward, every gradient accumulated into a
    parameter and every optimizer step, each tagged with its phase (``forward``, ``backward``,
    ``optimizer``): where in the step memory rises and falls. Forwards that activation checkpointing
    re-runs in backward, and optimizer steps taken inside backward, appear in the ``backward`` phase.

    Args:
        step: the ``trainer.global_step`` to measure; the second step (``1``) is the first whose
            optimizer state exists from its start. Default: ``1``.

    Attributes:
        report: the :class:`~lightning_lowmem.memory.MemoryReport` of the step, after it ran.
        timeline: ``[(phase, live_bytes), ...]`` in the order the events happened.

    Example::

        >>> from lightning_lowmem.demo import CharLM, CharLMDataModule
        >>> profile = StepMemoryProfile(step=1)
        >>> trainer = L.Trainer(max_steps=2, callbacks=[profile], logger=False, enable_progress_bar=False,
        ...                     enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
        >>> trainer.fit(CharLM(n_layer=1, n_embd=32, n_head=2, block_size=16),
        ...             CharLMDataModule(block_size=16, batch_size=4, max_chars=20_000))
        >>> [phase for phase in ("forward", "backward", "optimizer") if any(p == phase for p, _ in profile.timeline)]
        ['forward', 'backward', 'optimizer']
        >>> profile.report.peak_bytes >= max(live for _, live in profile.timeline)
        True
    """

    def __init__(self, step: int = 1) -> None:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"`step` must be an int >= 0, got {step!r}")
        self.step = step
        self.report: MemoryReport | None = None
        self.timeline: list[tuple[str, int]] = []
        self._stack: contextlib.ExitStack | None = None
        self._tracking: Any = None
        self._phase = "forward"

    def _sample(self, *_: Any) -> None:
        if self._tracking is not None:
            self.timeline.append((self._phase, self._tracking.current_bytes))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.sanity_checking or trainer.global_step != self.step or self._stack is not None or self.report:
            return
        stack = contextlib.ExitStack()
        self._tracking = stack.enter_context(
            track_memory(pl_module, list(trainer.optimizers), device=pl_module.device.type, by_module=False)
        )
        stack.callback(nn.modules.module.register_module_forward_hook(self._sample).remove)
        stack.callback(register_optimizer_step_post_hook(self._sample).remove)
        for param in pl_module.parameters():
            if param.requires_grad:
                stack.callback(param.register_post_accumulate_grad_hook(self._sample).remove)
        self._stack, self._phase, self.timeline = stack, "forward", []
        self._sample()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._sample()
        self._phase = "backward"

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._sample()
        self._phase = "optimizer"

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._stack is None:
            return
        self._sample()
        self._close()

    def _close(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()  # hooks removed first (LIFO), then the tracking ends and writes its report
            self.report = self._tracking.report
        self._tracking = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._close()
