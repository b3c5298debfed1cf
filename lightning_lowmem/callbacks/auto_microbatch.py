"""`AutoMicrobatch`: on out-of-memory, retry the same batch in micro-batches with gradient accumulation."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lowmem.functional.config import MicrobatchConfig
from lightning_lowmem.functional.microbatch import MicrobatchLoop, batch_size_of, slice_batch
from lightning_lowmem.callbacks._technique_base import TechniqueCallback

__all__ = ["AutoMicrobatch", "batch_size_of", "slice_batch"]


class AutoMicrobatch(TechniqueCallback):
    """Survive out-of-memory errors in training by splitting the batch into micro-batches.

    When a training step raises ``torch.OutOfMemoryError`` (CUDA, ROCm and XPU raise it; a plain
    ``RuntimeError`` is never taken for one), the callback frees what the failed attempt held and runs
    the *same* batch again as micro-batches of half the size, accumulating their gradients. Each
    micro-batch loss is weighted by its share of the batch, so for losses that are a mean over the
    batch the accumulated gradient equals the full batch's, and the optimizer steps exactly as often
    as without it. It halves again on a further OOM, keeps the size that worked for later batches (and
    in its ``state_dict``, so a resumed run starts with it) and raises a clear error when even one
    sample per micro-batch does not fit.

    How: in ``setup`` the LightningModule's ``training_step`` is wrapped
    (:class:`lightning_lowmem.functional.microbatch.MicrobatchLoop`, which the low-memory strategies use for
    planned micro-batches too, with the estimator's splitting function); the wrapper runs forward and
    backward for each micro-batch itself (so an OOM in backward is caught too) and returns the batch
    loss detached from the graph, so the backward Lightning then runs costs nothing. The gradient
    zeroing Lightning does between ``training_step`` and backward is moved before the wrapper's first
    backward (``optimizer_zero_grad`` is wrapped too). Both are restored in ``teardown``.

    Under DDP the ranks all-reduce one small flag every step, so when any rank runs out of memory all
    of them retry with the same micro-batch size and none waits forever. The micro-batch backwards
    run inside DDP's forward, where DDP does not synchronise; the loss returned to Lightning touches
    every parameter with a zero weight, so Lightning's backward triggers DDP's usual all-reduce of the
    accumulated gradients once per step. (That all-reduce no longer overlaps the backward compute.)

    Limits: automatic optimization only; not with optimizer-in-backward (``*_in_backward``); for
    single-device and DDP strategies (not FSDP / DeepSpeed). Things ``training_step`` logs with
    ``self.log`` are logged per micro-batch (the last one wins for ``on_step`` values). With
    ``accumulate_grad_batches > 1`` an OOM inside a backward that is not the first of an accumulation
    window cannot be undone (gradients of earlier batches are mixed in) and raises an error.

    Args:
        micro_batch_size: start with micro-batches of this size instead of whole batches (e.g. from
            :func:`~lightning_lowmem.plan_memory`); ``None`` tries whole batches first. Default: ``None``.

    Raises:
        ValueError: ``micro_batch_size`` is not a positive int or ``None``; in ``setup`` /
            ``on_fit_start``: manual optimization or an optimizer-in-backward.
        torch.OutOfMemoryError: a micro-batch of one sample still runs out of memory.

    Example::

        >>> callback = AutoMicrobatch()
        >>> callback.state_dict()
        {'micro_batch_size': None}
    """

    technique = "microbatch"
    changes_step = True  # its loop runs forward and backward per micro-batch
    tags = frozenset({"microbatch"})

    def __init__(self, micro_batch_size: int | None = None) -> None:
        self.config = MicrobatchConfig(micro_batch_size) if micro_batch_size is not None else None  # validates
        self._loop = MicrobatchLoop(micro_batch_size, info=rank_zero_info)

    @property
    def micro_batch_size(self) -> int | None:
        """The current micro-batch size (``None``: whole batches); it shrinks after an out-of-memory error."""
        return self._loop.micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value: int | None) -> None:
        self._loop.micro_batch_size = value

    @override
    def setup_technique(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._loop.wrap(pl_module)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._loop.check_optimizers(trainer.optimizers)
        if self.micro_batch_size is not None:
            rank_zero_info(f"AutoMicrobatch: starting with micro-batches of {self.micro_batch_size} samples")

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._loop.begin_batch(batch_idx, trainer.accumulate_grad_batches)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.micro_batch_size is not None:
            pl_module.log(
                "lowmem/micro_batch_size", float(self.micro_batch_size), on_step=True, on_epoch=False, batch_size=1
            )

    @override
    def release(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._loop.unwrap()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.micro_batch_size = state_dict.get("micro_batch_size", self.micro_batch_size)
