"""`AutoMicrobatch`: on out-of-memory, retry the same batch in micro-batches with gradient accumulation."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

__all__ = ["AutoMicrobatch", "batch_size_of", "slice_batch"]

# outcome of one attempt, agreed across ranks by an all-reduce MAX (higher = worse)
_OK, _RETRY, _FAILED_AT_ONE, _FAILED_ACCUMULATING, _FAILED_UNSPLITTABLE = 0, 1, 2, 3, 4
_NO_PROPOSAL = 2**62  # a rank that did not run out of memory proposes no micro-batch size


def batch_size_of(batch: Any) -> int:
    """The size of dim 0 shared by every tensor (of dim >= 1) in ``batch``.

    Raises:
        ValueError: ``batch`` holds no such tensor, or its tensors disagree on dim 0.
    """
    sizes: set[int] = set()
    apply_to_collection(batch, torch.Tensor, lambda t: sizes.add(t.shape[0]) if t.dim() else None)
    if len(sizes) != 1:
        found = "no tensor with a batch dimension" if not sizes else f"tensors with dim-0 sizes {sorted(sizes)}"
        raise ValueError(
            f"AutoMicrobatch cannot split this batch ({type(batch).__name__}): it has {found}. Batches must be "
            "tensors, or lists / tuples / dicts / dataclasses of tensors that share dim 0 (0-dim tensors and "
            "non-tensors are passed whole to every micro-batch)."
        )
    return sizes.pop()


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor (dim >= 1) in ``batch``, as views; other leaves unchanged.

    Example::

        >>> part = slice_batch({"x": torch.zeros(8, 3), "scale": 2.0}, 0, 4)
        >>> part["x"].shape, part["scale"]
        (torch.Size([4, 3]), 2.0)
    """
    return apply_to_collection(batch, torch.Tensor, lambda t: t[start:stop] if t.dim() else t)


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    return None


@dataclass
class _Progress:
    """What of the current batch is done: samples whose forward *and* backward completed."""

    done: int = 0
    loss_sum: torch.Tensor | None = None  # sum of share-weighted micro-batch losses (detached)
    extras: dict[str, Any] | None = None  # non-loss keys of the last micro-batch's output dict
    finished: bool = False
    in_backward: bool = False
    returned_none: bool = False


class AutoMicrobatch(L.Callback):
    """Survive out-of-memory errors in training by splitting the batch into micro-batches.

    When a training step raises ``torch.OutOfMemoryError`` (CUDA, ROCm and XPU raise it; a plain
    ``RuntimeError`` is never taken for one), the callback frees what the failed attempt held and runs
    the *same* batch again as micro-batches of half the size, accumulating their gradients. Each
    micro-batch loss is weighted by its share of the batch, so for losses that are a mean over the
    batch the accumulated gradient equals the full batch's, and the optimizer steps exactly as often
    as without it. It halves again on a further OOM, keeps the size that worked for later batches (and
    in its ``state_dict``, so a resumed run starts with it) and raises a clear error when even one
    sample per micro-batch does not fit.

    How: in ``setup`` the LightningModule's ``training_step`` is wrapped; the wrapper runs forward and
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

    def __init__(self, micro_batch_size: int | None = None) -> None:
        if micro_batch_size is not None and (
            isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1
        ):
            raise ValueError(
                f"`micro_batch_size` must be a positive int or None, got {micro_batch_size!r}; None starts with "
                "whole batches and splits only after an out-of-memory error."
            )
        self.micro_batch_size = micro_batch_size
        self._module: L.LightningModule | None = None
        self._originals: dict[str, Any] = {}
        self._zero_grad_due = True
        self._batch_idx = 0
        self._unsplittable: ValueError | None = None

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self._module is not None:
            return
        if not pl_module.automatic_optimization:
            raise ValueError(
                f"AutoMicrobatch needs automatic optimization, but {type(pl_module).__name__}.automatic_optimization "
                "is False. With manual optimization, split the batch in your own training_step (catch "
                "torch.OutOfMemoryError, zero the gradients, loop over micro-batches calling manual_backward)."
            )
        # keep any instance-level override so teardown puts back exactly what was there
        self._originals = {name: pl_module.__dict__.get(name) for name in ("training_step", "optimizer_zero_grad")}
        training_step, optimizer_zero_grad = pl_module.training_step, pl_module.optimizer_zero_grad

        def wrapped_training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            return self._training_step(training_step, optimizer_zero_grad, batch, args, kwargs)

        def wrapped_optimizer_zero_grad(*args: Any, **kwargs: Any) -> None:
            pass  # done by the training_step wrapper before its first backward (see the class docstring)

        pl_module.training_step = wrapped_training_step  # type: ignore[method-assign]
        pl_module.optimizer_zero_grad = wrapped_optimizer_zero_grad  # type: ignore[method-assign]
        self._module = pl_module

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            if hasattr(optimizer, "inner_optimizers"):  # OptimizerInBackward steps inside every backward
                raise ValueError(
                    f"AutoMicrobatch cannot work with {type(optimizer).__name__} (optimizer-in-backward): each "
                    "micro-batch backward would be an optimizer step. Use a plain optimizer (e.g. 'adamw8bit')."
                )
        if self.micro_batch_size is not None:
            rank_zero_info(f"AutoMicrobatch: starting with micro-batches of {self.micro_batch_size} samples")

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_idx = batch_idx
        # the same rule as Lightning's: gradients are zeroed on the first batch of each accumulation window
        self._zero_grad_due = batch_idx % trainer.accumulate_grad_batches == 0

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.micro_batch_size is not None:
            pl_module.log("lowmem/micro_batch_size", float(self.micro_batch_size), on_step=True, on_epoch=False,
                          batch_size=1)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._module is None:
            return
        for name, original in self._originals.items():
            if original is None:
                self._module.__dict__.pop(name, None)
            else:
                self._module.__dict__[name] = original
        self._module = None
        self._originals = {}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.micro_batch_size = state_dict.get("micro_batch_size", self.micro_batch_size)

    # ------------------------------------------------------------------ the wrapped step
    def _training_step(
        self, training_step: Callable[..., Any], zero_grad: Callable[..., Any], batch: Any, args: tuple, kwargs: dict
    ) -> Any:
        module = self._module
        assert module is not None
        trainer = module.trainer
        if self._zero_grad_due:
            self._zero_grad(trainer, zero_grad)
        progress = _Progress()
        batch_size: int | None = None  # inspected only when the batch is split
        while True:
            if self.micro_batch_size is not None and batch_size is None:
                batch_size = batch_size_of(batch)
            size = batch_size  # None: the whole batch, unsplit
            if self.micro_batch_size is not None and batch_size is not None:
                size = min(self.micro_batch_size, batch_size)
            outcome, proposal = _OK, _NO_PROPOSAL
            if not progress.finished:
                oom = False
                try:
                    self._run(training_step, batch, batch_size, size, progress, args, kwargs)
                except torch.OutOfMemoryError:
                    oom = True  # handled outside the except block, so the traceback's tensors are freed
                if oom:
                    outcome, proposal = self._after_oom(trainer, batch, size, progress)
            outcome, proposal = self._agree(trainer, outcome, proposal)
            if outcome == _OK:
                break
            if outcome == _FAILED_UNSPLITTABLE:
                raise self._unsplittable or ValueError(
                    "AutoMicrobatch: another rank ran out of memory on a batch it cannot split into micro-batches"
                )
            if batch_size is None:
                batch_size = batch_size_of(batch)
            current = self.micro_batch_size or batch_size
            if outcome == _FAILED_AT_ONE:
                raise torch.OutOfMemoryError(
                    f"AutoMicrobatch: out of memory even with micro-batches of 1 sample (batch of {batch_size}"
                    f"{'' if trainer.world_size == 1 else ', on at least one rank'}). The model, its gradients and "
                    "optimizer state do not fit alongside one sample's activations: try ActivationCheckpointing, "
                    "a lean optimizer (MemoryEfficientOptimizer), a lower precision, or `lowmem estimate`."
                )
            if outcome == _FAILED_ACCUMULATING:
                raise torch.OutOfMemoryError(
                    f"AutoMicrobatch: out of memory inside a backward on batch {self._batch_idx}, which is not the "
                    f"first of an accumulation window (accumulate_grad_batches={trainer.accumulate_grad_batches}): "
                    "the gradients of earlier batches are mixed with a partial one and cannot be undone. Use "
                    "accumulate_grad_batches=1 with a larger batch size (AutoMicrobatch accumulates for you), or "
                    f"start with AutoMicrobatch(micro_batch_size={max(1, current // 2)})."
                )
            self.micro_batch_size = proposal
            rank_zero_info(
                f"AutoMicrobatch: out of memory on a batch of {batch_size} in micro-batches of {current}; retrying "
                f"the same batch in micro-batches of {proposal} (effective batch and optimizer steps unchanged)"
            )
        return self._closure_output(module, trainer, progress)

    def _run(
        self,
        training_step: Callable[..., Any],
        batch: Any,
        batch_size: int | None,
        size: int | None,
        progress: _Progress,
        args: tuple,
        kwargs: dict,
    ) -> None:
        """Forward + backward of the batch's remaining samples, ``size`` at a time (``None``: whole batch)."""
        module = self._module
        assert module is not None
        scaler = getattr(module.trainer.precision_plugin, "scaler", None)  # GradScaler of "16-mixed"
        accumulate = module.trainer.accumulate_grad_batches
        starts = [None] if size is None or batch_size is None else range(progress.done, batch_size, size)
        for start in starts:
            if start is None:  # whole batch, not split
                chunk, rows, share = batch, 0, 1.0
            else:
                assert size is not None and batch_size is not None
                stop = min(start + size, batch_size)
                chunk, rows, share = slice_batch(batch, start, stop), stop - start, (stop - start) / batch_size
            output = training_step(chunk, *args, **kwargs)
            loss = _loss_of(output)
            if output is None:
                progress.returned_none = True
            elif loss is not None and loss.requires_grad:
                scaled = loss * (share / accumulate)  # Lightning divides its own loss by `accumulate` too
                progress.in_backward = True
                module.backward(scaler.scale(scaled) if scaler is not None else scaled)
                progress.in_backward = False
            if loss is not None:
                weighted = loss.detach() * share
                progress.loss_sum = weighted if progress.loss_sum is None else progress.loss_sum + weighted
            if isinstance(output, dict):
                progress.extras = {key: value for key, value in output.items() if key != "loss"}
            del output, loss, chunk
            progress.done += rows
        progress.finished = True

    def _after_oom(self, trainer: L.Trainer, batch: Any, size: int | None, progress: _Progress) -> tuple[int, int]:
        """Free what the failed attempt held; return this rank's outcome and proposed micro-batch size."""
        module = self._module
        assert module is not None
        outcome = _RETRY
        if progress.in_backward:  # a partial backward added to some gradients: start the batch over
            progress.in_backward = False
            if self._zero_grad_due:
                module.zero_grad(set_to_none=True)
                progress.done, progress.loss_sum, progress.extras = 0, None, None
            else:
                outcome = _FAILED_ACCUMULATING
        gc.collect()
        if torch.cuda.is_available() and module.device.type == "cuda":
            torch.cuda.empty_cache()
        if size is None:
            try:
                size = batch_size_of(batch)
            except ValueError as error:
                self._unsplittable = error
                return _FAILED_UNSPLITTABLE, _NO_PROPOSAL
        current = size
        if current <= 1:
            return max(outcome, _FAILED_AT_ONE), _NO_PROPOSAL
        return outcome, current // 2

    def _agree(self, trainer: L.Trainer, outcome: int, proposal: int) -> tuple[int, int]:
        """Under DDP, the worst outcome and the smallest proposed size over all ranks (one all-reduce)."""
        if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return outcome, proposal
        assert self._module is not None
        # MAX of (outcome, -proposal) = worst outcome and smallest proposal, in one collective
        flags = torch.tensor([outcome, -proposal], dtype=torch.int64, device=self._module.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return int(flags[0]), -int(flags[1])

    def _zero_grad(self, trainer: L.Trainer, zero_grad: Callable[..., Any]) -> None:
        if trainer.optimizers:
            zero_grad(trainer.current_epoch, self._batch_idx, trainer.optimizers[0])
        else:
            self._module.zero_grad(set_to_none=True)  # type: ignore[union-attr]

    def _closure_output(self, module: L.LightningModule, trainer: L.Trainer, progress: _Progress) -> Any:
        """What Lightning gets back: the batch loss, detached, with a graph whose backward adds zeros."""
        if progress.loss_sum is None:
            return None if progress.returned_none else progress.extras
        loss = progress.loss_sum
        if trainer.world_size > 1:
            # DDP all-reduces gradients from hooks that fire when each parameter's gradient is accumulated:
            # touch every trainable parameter with weight 0 so the accumulated gradients are reduced
            # (d(0 * p.sum())/dp is an expanded zero, so no parameter-sized tensor is allocated)
            touched = [p.sum() * 0.0 for p in module.parameters() if p.requires_grad]
            if touched:
                return self._with_extras(loss + sum(touched).to(loss.dtype), progress)
        return self._with_extras(loss.clone().requires_grad_(), progress)

    @staticmethod
    def _with_extras(loss: torch.Tensor, progress: _Progress) -> Any:
        return loss if progress.extras is None else {"loss": loss, **progress.extras}
