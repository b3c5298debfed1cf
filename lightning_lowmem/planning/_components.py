"""The planner's per-axis measurements: measure what differs between candidates once, then combine.

A training step's memory splits along the technique axes:

* the **model side** (precision, checkpointing, compression, micro-batches, LoRA) decides parameters,
  gradients, activations and what forward / backward allocate. A :class:`ModelProbe` runs that step once
  on fake tensors with an optimizer that keeps no state and steps nothing, and records its peak and
  the bytes alive when ``optimizer.step()`` is called;
* the **optimizer** adds its state for the whole step and, during ``step()``, its temporaries. Both
  depend only on the parameters it steps (shapes, strides, dtypes), not on the model's activations: an
  :class:`OptimizerProfile` measures them on bare fake parameters of those shapes, without the model.

A candidate's peak is then ``max(probe peak + state, bytes at step + state + step temporaries)``
(:func:`combine`): one model-side run serves every optimizer, and one optimizer profile serves every
model-side configuration with the same trainable parameters. Optimizers that step inside backward
interleave both sides and are estimated whole. The planner re-estimates the chosen candidate with the
full :func:`~lightning_lowmem.planning.estimate.estimate_memory` and reports both figures.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lightning_lowmem._compat.autograd import in_backward
from lightning_lowmem._compat.compiler import force_eager
from lightning_lowmem._compat.fake_mode import fake_tensor_mode
from lightning_lowmem.planning._batch_values import BatchValues
from lightning_lowmem.planning._fake_step import (
    OptimizerScalars,
    apply_model_techniques,
    build_lookup_tables,
    build_optimizer,
    create_state,
    fake_batch,
    fake_gradients,
    fake_module,
    train_step,
)
from lightning_lowmem.memory._tensors import iter_tensors
from lightning_lowmem.memory._tracker import MemoryLimitExceeded, PhaseReached, StorageTracker
from lightning_lowmem.memory.cuda_allocator import cuda_block_bytes
from lightning_lowmem.planning.attention_kernels import fake_attention
from lightning_lowmem.planning.cuda_autocast import cuda_autocast_rules
from lightning_lowmem.memory.report import CATEGORIES

Signature = tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]
"""Shape, stride and dtype of every parameter an optimizer steps, in order."""


@dataclass(frozen=True)
class ModelProbe:
    """The model side of a step: its peak without optimizer state, and what is alive at ``step()``.

    ``stopped_at`` is set when the run was stopped as soon as its live bytes passed that limit: then
    ``peak_bytes`` is only a lower bound and the step figures are unknown (0). ``forward_only``: the run was
    asked to stop when backward starts and did so below the limit: ``peak_bytes`` is the forward's peak only.
    """

    peak_bytes: int
    peak_breakdown: dict[str, int]
    step_bytes: int
    step_breakdown: dict[str, int]
    trainable: Signature
    stopped_at: int | None = None
    forward_only: bool = False
    segments: Segments | None = None


@dataclass(frozen=True)
class Cuts:
    """Where ``probe_model`` cuts its run (module names in the probed module): at the first forward of each of
    ``forward``, then as the gradient of each of ``backward``'s outputs is complete (its backward starts), in that
    order; ``held``: the module whose parameters, buffers and gradients are read at the first cut."""

    forward: tuple[str, ...]
    held: str
    backward: tuple[str, ...] = ()


@dataclass(frozen=True)
class Segments:
    """A run cut at modules' first forwards (``probe_model``'s ``cut_at``): each segment's peak (before the first
    cut, then from each cut on) and the live state at each cut, as ``(bytes, breakdown)``; ``held``: the bytes by
    category of the tensors named to be read at the first cut."""

    peaks: list[tuple[int, dict[str, int]]]
    starts: list[tuple[int, dict[str, int]]]
    held: dict[str, int]
    held_trainable: tuple[int, int] = (0, 0)
    """Where ``held``'s trained parameters are in ``ModelProbe.trainable``: (first index, count)."""


@dataclass(frozen=True)
class OptimizerProfile:
    """What an optimizer adds: its state, and its temporaries above parameters + gradients + state."""

    state_bytes: int
    step_extra_bytes: int


class _StatelessOptimizer(torch.optim.Optimizer):
    """Keeps no state and steps nothing; notes the tracker's live bytes when ``step()`` is called."""

    def __init__(self, params: list[torch.Tensor], tracker: StorageTracker) -> None:
        super().__init__(params, {})
        self.tracker = tracker
        self.step_bytes = 0
        self.step_breakdown: dict[str, int] = dict.fromkeys(CATEGORIES, 0)

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        self.step_bytes = self.tracker.current_bytes
        self.step_breakdown = self.tracker.current_breakdown


def _round(device: str) -> Callable[[int], int] | None:
    return cuda_block_bytes if device == "cuda" else None


def probe_model(
    module: nn.Module,
    batch: Any,
    config: Any,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    device: str,
    loop: str,
    limit_bytes: int | None = None,
    attention_kernel: str = "auto",
    forward_only: bool = False,
    accumulate: int = 1,
    cut_at: Cuts | None = None,
) -> ModelProbe:
    """Run ``config``'s model side once on fake tensors (the optimizer is left out; see module docstring).

    With ``loop="lightning"`` the previous step's gradients are alive during the forward, as in the
    full estimate's second step. With ``limit_bytes`` the run stops as soon as more bytes than that are
    alive: a candidate that cannot fit is known without running the rest of its step. ``forward_only``: the
    run also stops when backward starts (about a third of a step's ops): below the limit by then, the
    probe says only that (``ModelProbe.forward_only``). ``accumulate``: the step runs that many batches (see
    :func:`~lightning_lowmem.planning._fake_step.train_step`). ``cut_at``: the run is cut there (:class:`Cuts`), each
    segment's peak kept (``ModelProbe.segments``; ``None`` if a cut was not reached).
    """
    true_dtype = config.precision.true_dtype
    autocast_dtype = config.precision.autocast_dtype
    tracker = StorageTracker(device="cpu", round_bytes=_round(device), by_module=False)
    fake_mode = fake_tensor_mode()
    model = fake_module(module, true_dtype, fake_mode)
    attention = fake_attention(batch, device, attention_kernel)  # as estimate_memory: the real batch's masks
    rules = cuda_autocast_rules(device, autocast_dtype)  # as estimate_memory: CUDA autocast's op rules
    with attention, rules, fake_mode, warnings.catch_warnings(), force_eager():
        warnings.simplefilter("ignore")
        model.train()
        apply_model_techniques(model, config)
        inputs = fake_batch(batch, true_dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = _StatelessOptimizer(params, tracker)
        if loop == "lightning":
            fake_gradients(params)  # left by the previous step until Lightning's zero_grad
        tracker.modules = [model]
        handles = _cut(model, tracker, cut_at) if cut_at is not None else []
        tracker.limit_bytes = limit_bytes
        tracker.stop_before_phase = "backward" if forward_only else None
        stopped = forward_done = False
        try:
            with BatchValues(batch, inputs), tracker:
                train_step(model, inputs, loss_fn, optimizer, config, autocast_dtype, True, loop, accumulate)
        except MemoryLimitExceeded:
            stopped = True
        except PhaseReached:
            forward_done = True
        for handle in handles:
            handle.remove()
    report = tracker.report
    assert report is not None
    trainable = tuple((tuple(p.shape), tuple(p.stride()), p.dtype) for p in params)
    segments = _segments(tracker, model, params, cut_at) if cut_at is not None else None
    if stopped or forward_done:
        nothing = dict.fromkeys(CATEGORIES, 0)
        return ModelProbe(
            report.peak_bytes,
            report.breakdown,
            0,
            nothing,
            trainable,
            limit_bytes if stopped else None,
            forward_done,
            segments,
        )
    return ModelProbe(
        report.peak_bytes,
        report.breakdown,
        optimizer.step_bytes,
        optimizer.step_breakdown,
        trainable,
        segments=segments,
    )


def _cut(model: nn.Module, tracker: StorageTracker, cuts: Cuts) -> list[Any]:
    """Set ``tracker`` to cut its run at ``cuts``; the hooks that cut at backward starts (to remove after the run)."""
    block = model.get_submodule(cuts.held)
    grads = [p.grad for p in block.parameters() if p.grad is not None]
    marks = (*cuts.forward, *(f"{name} backward" for name in cuts.backward))
    tracker.segments.cut_at(marks, [*block.parameters(), *block.buffers(), *grads])

    def on_output(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            first = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(first, torch.Tensor) and first.requires_grad and not in_backward():  # not a recomputation
                first.register_hook(lambda grad: tracker.segments.cut(f"{name} backward"))

        return hook

    return [model.get_submodule(name).register_forward_hook(on_output(name)) for name in cuts.backward]


def _segments(tracker: StorageTracker, model: nn.Module, params: list[torch.Tensor], cuts: Cuts) -> Segments | None:
    cut = tracker.segments
    if len(cut.starts) < len(cut.marks):
        return None  # a cut never came (a technique renamed a module, an output needs no gradient, a stopped run)
    held = {id(p) for p in model.get_submodule(cuts.held).parameters()}
    where = [index for index, param in enumerate(params) if id(param) in held]
    return Segments(
        [(snap.total, dict(snap.breakdown)) for snap in cut.peaks],
        [(snap.total, dict(snap.breakdown)) for snap in cut.starts],
        dict(cut.held),
        (where[0], len(where)) if where else (0, 0),
    )


def profile_optimizer(name: str, trainable: Signature, *, device: str, kwargs: dict[str, Any]) -> OptimizerProfile:
    """Measure optimizer ``name`` on bare fake parameters shaped as ``trainable`` (no model, no forward).

    Parameters of one shape behave alike, so a long signature (a deep model repeats its blocks) is
    measured on each distinct shape once, then again with one shape twice: when the repeated parameter
    gets the same state as its twin, nothing else grows, and the step's temporaries stay the same (the
    optimizer steps one parameter at a time), the whole model's figures follow by counting; otherwise
    (e.g. ``foreach`` kernels, whose temporaries span every parameter) the whole signature is measured.
    """
    build_lookup_tables(name)
    counts = Counter(trainable)
    if 3 * len(counts) < len(trainable):
        unique = list(counts)
        smallest = min(range(len(unique)), key=lambda i: math.prod(unique[i][0]))
        once = _measure_optimizer(name, unique, device, kwargs)
        again = _measure_optimizer(name, unique + [unique[smallest]], device, kwargs)  # one shape twice
        per_param = once.per_param_state
        if (
            again.per_param_state == per_param + [per_param[smallest]]
            and again.shared_bytes == once.shared_bytes  # e.g. torchao's lr tensor: once per optimizer
            and again.step_extra_bytes == once.step_extra_bytes  # one parameter at a time
        ):
            state = once.shared_bytes + sum(
                counts[signature] * bytes_ for signature, bytes_ in zip(unique, per_param, strict=True)
            )
            return OptimizerProfile(state, once.step_extra_bytes)
    whole = _measure_optimizer(name, list(trainable), device, kwargs)
    return OptimizerProfile(whole.state_bytes, whole.step_extra_bytes)


@dataclass(frozen=True)
class _OptimizerRun:
    state_bytes: int  # everything the optimizer keeps between steps (state, float32 copies...)
    step_extra_bytes: int
    per_param_state: list[int]  # ``optimizer.state[p]`` bytes per parameter
    shared_bytes: int  # kept, but in no parameter's state


def _measure_optimizer(name: str, trainable: list, device: str, kwargs: dict[str, Any]) -> _OptimizerRun:
    rounding = _round(device) or (lambda n: n)
    tracker = StorageTracker(device="cpu", round_bytes=_round(device), by_module=False)
    with fake_tensor_mode(), warnings.catch_warnings(), force_eager():
        warnings.simplefilter("ignore")
        params = [nn.Parameter(torch.empty_strided(shape, stride, dtype=dtype)) for shape, stride, dtype in trainable]
        optimizer = build_optimizer(name, params, kwargs)
        create_state(optimizer, params)  # the state a first step leaves; gradients stay set
        tracker.optimizers = [optimizer]
        with tracker:
            with OptimizerScalars():
                optimizer.step()
        report = tracker.report
        assert report is not None
        # what stays after a step (state, an optimizer's own float32 copies...) is resident through the
        # whole training step; the rest of the step's peak are its temporaries
        params_and_grads = sum(
            rounding(t.untyped_storage().nbytes()) for p in params for t in (p, p.grad) if t is not None
        )
        resident = report.end_bytes - params_and_grads
        per_param = [_storage_bytes(optimizer.state.get(p, {}), rounding) for p in params]
    return _OptimizerRun(resident, report.peak_bytes - report.end_bytes, per_param, resident - sum(per_param))


def _storage_bytes(state: Any, rounding: Callable[[int], int]) -> int:
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in iter_tensors(state)}
    return sum(rounding(n) for n in storages.values())


def combine(probe: ModelProbe, profile: OptimizerProfile) -> tuple[int, dict[str, int]]:
    """A candidate's predicted peak and its breakdown from its model probe and optimizer profile (a lower
    bound when the probe was stopped)."""
    if probe.stopped_at is not None:
        breakdown = dict(probe.peak_breakdown)
        breakdown["optimizer_state"] += profile.state_bytes
        return probe.peak_bytes + profile.state_bytes, breakdown
    during_backward = probe.peak_bytes + profile.state_bytes
    during_step = probe.step_bytes + profile.state_bytes + profile.step_extra_bytes
    if during_backward >= during_step:
        breakdown = dict(probe.peak_breakdown)
    else:
        breakdown = dict(probe.step_breakdown)
        breakdown["other"] += profile.step_extra_bytes
    breakdown["optimizer_state"] += profile.state_bytes
    return max(during_backward, during_step), breakdown
