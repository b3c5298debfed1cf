"""Micro-batches: split a batch along dim 0, and the loop that runs a training step on it in pieces.

One splitting function (:func:`split_batch`, built on :func:`batch_size_of` and :func:`slice_batch`) serves
the ``AutoMicrobatch`` callback, the low-memory strategies' planned micro-batches and the estimator's step
(:mod:`lightning_lowmem.planning._fake_step`), so a plan's micro-batches are the ones that run.

:class:`MicrobatchLoop` wraps a LightningModule's ``training_step`` (duck-typed: no Lightning import) so
that it runs forward and backward per micro-batch, accumulating gradients with each micro-batch's share
of the batch, and retries the same batch in halves after ``torch.OutOfMemoryError``. See
:class:`~lightning_lowmem.callbacks.auto_microbatch.AutoMicrobatch` for the full story.

Example::

    >>> parts = split_batch({"x": torch.zeros(5, 3), "scale": 2.0}, 2)
    >>> [part["x"].shape[0] for part in parts], parts[-1]["scale"]
    ([2, 2, 1], 2.0)
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

__all__ = ["MicrobatchLoop", "batch_size_of", "slice_batch", "split_batch"]

log = logging.getLogger(__name__)

# outcome of one attempt, agreed across ranks by an all-reduce MAX (higher = worse)
_OK, _RETRY, _FAILED_AT_ONE, _FAILED_ACCUMULATING, _FAILED_UNSPLITTABLE = 0, 1, 2, 3, 4
_NO_PROPOSAL = 2**62  # a rank that did not run out of memory proposes no micro-batch size


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with ``fn`` applied to every tensor inside mappings, lists, tuples (named too) and dataclasses."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {key: _map_tensors(value, fn) for key, value in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:  # a mapping type that cannot be built from a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_tensors(value, fn) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(value, fn) for value in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {f.name: _map_tensors(getattr(batch, f.name), fn) for f in dataclasses.fields(batch) if f.init}
        return dataclasses.replace(batch, **changes)
    return batch


def batch_size_of(batch: Any) -> int:
    """The size of dim 0 shared by every tensor (of dim >= 1) in ``batch``.

    Raises:
        ValueError: ``batch`` holds no such tensor, or its tensors disagree on dim 0.
    """
    sizes: set[int] = set()
    _map_tensors(batch, lambda t: sizes.add(t.shape[0]) if t.dim() else None)
    if len(sizes) != 1:
        found = "no tensor with a batch dimension" if not sizes else f"tensors with dim-0 sizes {sorted(sizes)}"
        raise ValueError(
            f"cannot split this batch ({type(batch).__name__}) into micro-batches: it has {found}. Batches must be "
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
    return _map_tensors(batch, lambda t: t[start:stop] if t.dim() else t)


def spans(batch_size: int, size: int, start: int = 0) -> list[tuple[int, int]]:
    """``(start, stop)`` of each micro-batch of ``size`` rows from row ``start`` (the last may be smaller)."""
    return [(begin, min(begin + size, batch_size)) for begin in range(start, batch_size, size)]


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """``batch`` as micro-batches of ``micro_batch_size`` rows (views; the last may be smaller).

    Raises:
        ValueError: the batch cannot be split (see :func:`batch_size_of`).
    """
    return [slice_batch(batch, start, stop) for start, stop in spans(batch_size_of(batch), micro_batch_size)]


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


class MicrobatchLoop:
    """Run a LightningModule's training step in micro-batches, halving them after an out-of-memory error.

    :meth:`wrap` replaces the module's ``training_step`` (and ``optimizer_zero_grad``, whose zeroing moves
    before the first micro-batch's backward); :meth:`unwrap` puts back exactly what was there. Call
    :meth:`begin_batch` before each training batch. The module is used duck-typed (``trainer``,
    ``backward``, ``device``): nothing here imports Lightning.

    Args:
        micro_batch_size: start with micro-batches of this size; ``None`` tries whole batches first.
        info: where progress messages go (e.g. Lightning's ``rank_zero_info``). Default: this module's logger.
        owner: who runs it, for messages. Default: ``"AutoMicrobatch"``.
    """

    def __init__(
        self,
        micro_batch_size: int | None = None,
        info: Callable[[str], None] | None = None,
        owner: str = "AutoMicrobatch",
    ) -> None:
        self.micro_batch_size = micro_batch_size
        self.owner = owner
        self.info = info or log.info
        self.steps = 0  # training steps run through the wrapper
        self._module: Any = None
        self._originals: dict[str, Any] = {}
        self._zero_grad_due = True
        self._batch_idx = 0
        self._unsplittable: ValueError | None = None

    @property
    def wrapped(self) -> bool:
        return self._module is not None

    def wrap(self, module: Any) -> None:
        """Wrap ``module.training_step`` and ``module.optimizer_zero_grad`` (idempotent)."""
        if self._module is not None:
            return
        if not module.automatic_optimization:
            raise ValueError(
                f"{self.owner} needs automatic optimization, but {type(module).__name__}.automatic_optimization "
                "is False. With manual optimization, split the batch in your own training_step (catch "
                "torch.OutOfMemoryError, zero the gradients, loop over micro-batches calling manual_backward)."
            )
        # keep any instance-level override so unwrap puts back exactly what was there
        self._originals = {name: module.__dict__.get(name) for name in ("training_step", "optimizer_zero_grad")}
        training_step, optimizer_zero_grad = module.training_step, module.optimizer_zero_grad

        def wrapped_training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            return self._training_step(training_step, optimizer_zero_grad, batch, args, kwargs)

        def wrapped_optimizer_zero_grad(*args: Any, **kwargs: Any) -> None:
            pass  # done by the training_step wrapper before its first backward

        module.training_step = wrapped_training_step
        module.optimizer_zero_grad = wrapped_optimizer_zero_grad
        self._module = module

    def unwrap(self) -> None:
        """Restore what :meth:`wrap` replaced (idempotent)."""
        if self._module is None:
            return
        for name, original in self._originals.items():
            if original is None:
                self._module.__dict__.pop(name, None)
            else:
                self._module.__dict__[name] = original
        self._module = None
        self._originals = {}

    def begin_batch(self, batch_idx: int, accumulate_grad_batches: int) -> None:
        """Before each training batch: gradients are zeroed on the first batch of each accumulation window."""
        self._batch_idx = batch_idx
        self._zero_grad_due = batch_idx % accumulate_grad_batches == 0

    def check_optimizers(self, optimizers: list[Any]) -> None:
        """Refuse an optimizer-in-backward: each micro-batch backward would be an optimizer step."""
        for optimizer in optimizers:
            if hasattr(optimizer, "inner_optimizers"):
                raise ValueError(
                    f"{self.owner} cannot work with {type(optimizer).__name__} (optimizer-in-backward): each "
                    "micro-batch backward would be an optimizer step. Use a plain optimizer (e.g. 'adamw8bit')."
                )

    # ------------------------------------------------------------------ the wrapped step
    def _training_step(
        self, training_step: Callable[..., Any], zero_grad: Callable[..., Any], batch: Any, args: tuple, kwargs: dict
    ) -> Any:
        module = self._module
        assert module is not None
        trainer = module.trainer
        self.steps += 1
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
                    f"{self.owner}: another rank ran out of memory on a batch it cannot split into micro-batches"
                )
            if batch_size is None:
                batch_size = batch_size_of(batch)
            current = self.micro_batch_size or batch_size
            if outcome == _FAILED_AT_ONE:
                raise torch.OutOfMemoryError(
                    f"{self.owner}: out of memory even with micro-batches of 1 sample (batch of {batch_size}"
                    f"{'' if trainer.world_size == 1 else ', on at least one rank'}). The model, its gradients and "
                    "optimizer state do not fit alongside one sample's activations: try ActivationCheckpointing, "
                    "a lean optimizer (MemoryEfficientOptimizer), a lower precision, or `lowmem estimate`."
                )
            if outcome == _FAILED_ACCUMULATING:
                raise torch.OutOfMemoryError(
                    f"{self.owner}: out of memory inside a backward on batch {self._batch_idx}, which is not the "
                    f"first of an accumulation window (accumulate_grad_batches={trainer.accumulate_grad_batches}): "
                    "the gradients of earlier batches are mixed with a partial one and cannot be undone. Use "
                    "accumulate_grad_batches=1 with a larger batch size (AutoMicrobatch accumulates for you), or "
                    f"start with AutoMicrobatch(micro_batch_size={max(1, current // 2)})."
                )
            self.micro_batch_size = proposal
            self.info(
                f"{self.owner}: out of memory on a batch of {batch_size} in micro-batches of {current}; retrying "
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
        whole = size is None or batch_size is None
        for start, stop in [(0, 0)] if whole else spans(batch_size, size, progress.done):  # type: ignore[arg-type]
            if whole:  # whole batch, not split
                chunk, rows, share = batch, 0, 1.0
            else:
                assert batch_size is not None
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

    def _after_oom(self, trainer: Any, batch: Any, size: int | None, progress: _Progress) -> tuple[int, int]:
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

    def _agree(self, trainer: Any, outcome: int, proposal: int) -> tuple[int, int]:
        """Under DDP, the worst outcome and the smallest proposed size over all ranks (one all-reduce)."""
        if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return outcome, proposal
        assert self._module is not None
        # MAX of (outcome, -proposal) = worst outcome and smallest proposal, in one collective
        flags = torch.tensor([outcome, -proposal], dtype=torch.int64, device=self._module.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return int(flags[0]), -int(flags[1])

    def _zero_grad(self, trainer: Any, zero_grad: Callable[..., Any]) -> None:
        if trainer.optimizers:
            zero_grad(trainer.current_epoch, self._batch_idx, trainer.optimizers[0])
        else:
            self._module.zero_grad(set_to_none=True)  # type: ignore[union-attr]

    def _closure_output(self, module: Any, trainer: Any, progress: _Progress) -> Any:
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
