"""Evaluating the planner's candidates quickly: per-axis predictions from cached measurements, and full
estimates where a figure must be exact.

A :class:`CandidateEvaluator` keeps one :class:`~lightning_lowmem.planning._components.ModelProbe` per
model-side configuration (precision, checkpointing, compression, micro-batch, LoRA), one
:class:`~lightning_lowmem.planning._components.OptimizerProfile` per optimizer and trainable-parameter
set, and one full estimate per configuration asked for. Candidates that differ only in the optimizer
share a probe; candidates that differ only on the model side (with the same trainable parameters, e.g.
``32-true`` and ``bf16-mixed``) share a profile. On a model of alike blocks, a model side is first bounded from
below by two shallow copies of the model (``planning/_depth.py``): one whose bound passes the limit is ruled out
without a full-depth run; one that it does not rule out gets its full-depth figures from a 3-block copy's step,
where a 4-block copy's agrees (else the full depth runs).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from lightning_lowmem.functional.config import OptimizerConfig
from lightning_lowmem.planning.attention_kernels import validate_attention_kernel
from lightning_lowmem.planning._components import (
    Cuts,
    ModelProbe,
    OptimizerProfile,
    combine,
    probe_model,
    profile_optimizer,
)
from lightning_lowmem.planning._fake_step import device_optimizer_kwargs, resolve_loop
from lightning_lowmem.planning.axes import model_side_key
from lightning_lowmem.planning.estimate import (
    TrainingConfig,
    data_dependent_errors_explained,
    default_loss,
    estimate_memory,
)
from lightning_lowmem.memory.report import CATEGORIES, MemoryReport
from lightning_lowmem.planning.gpus import on_card

_WEIGHTS_KEPT = ("precision", "checkpointing", "compression", "optimizer", "microbatch", "lora", "cross_entropy")
"""Techniques that keep every weight in the precision's dtype: a model side with only these holds at least them."""


WHOLE_STEP_FROM = 0.8
"""The shallow copies' whole steps are run only for a forward whose bound is at least this share of the limit: a
backward rarely adds a fifth to the model side's peak, and where the bound cannot reject, the full-depth run
follows anyway (speed only: every candidate not rejected gets its full-depth figures)."""


class CandidateEvaluator:
    """Predicts the peak of a :class:`TrainingConfig` on one model and batch, reusing what it measured.

    Args:
        module: the model (not modified).
        batch: one batch.
        loss_fn: as for :func:`estimate_memory` (``None``: the model's own step).
        device: ``"cuda"`` or ``"cpu"``.
        loop: ``"auto"``, ``"lightning"`` or ``"torch"`` (see :func:`estimate_memory`).
        optimizer_kwargs: optimizer name -> the hyperparameters it takes from the optimizer asked for (the search's
            :meth:`~lightning_lowmem.planning.search.PlanSearch.kwargs_for`); a candidate's own win.
        attention_kernel: the CUDA attention kernel (see :func:`estimate_memory`).
        accumulate_grad_batches, gpu: see :func:`estimate_memory` (``gpu``: a resolved
            :class:`~lightning_lowmem.planning.gpus.GpuCard`).
    """

    def __init__(
        self,
        module: nn.Module,
        batch: Any,
        *,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
        device: str,
        loop: str,
        optimizer_kwargs: Callable[[str], dict[str, Any]],
        attention_kernel: str = "auto",
        accumulate_grad_batches: int = 1,
        gpu: Any = None,
    ) -> None:
        self.module = module
        self.accumulate, self.card = accumulate_grad_batches, gpu
        self.batch = batch
        self.user_loss_fn = loss_fn
        self.loss_fn = loss_fn or default_loss
        self.device = device
        self.attention_kernel = validate_attention_kernel(attention_kernel)
        self.loop = resolve_loop(module, loss_fn, loop)
        self.optimizer_kwargs = optimizer_kwargs
        self._probes: dict[tuple, ModelProbe] = {}
        self._profiles: dict[tuple, OptimizerProfile] = {}
        self._full: dict[TrainingConfig, MemoryReport] = {}
        self._failed: dict[Any, Exception] = {}  # a probe key / config that could not be built -> its error
        self._trainable: dict[tuple, Any] = {}  # (precision, lora) -> trainable signature, from a probe
        self._forward_peaks: dict[tuple, int] = {}  # model-side key -> its forward's peak, from a forward-only run
        self._parameter_count: tuple[int, int] | None = None  # floating parameters' elements, other bytes
        self._depth_bounds: dict[tuple, tuple[int, dict[str, int]] | None] = {}  # model-side key -> its secant bound
        self._stack: Any = False  # the model's DepthStack (None: none), found when first asked
        self.reserve_optimizers: list[str] = []
        """Optimizers whose state a limited model-side run reserves, once each was profiled: the run stops
        once the model side plus the smallest state among them passes the limit (no candidate fits then)."""
        self.full_estimates = 0
        self.probes = 0
        self.profiles = 0
        self.depth_bounds = 0
        """Runs of a shallow copy of the model, for the secant bound of ``planning/_depth.py``."""

    def predict(self, config: TrainingConfig, limit_bytes: int | None = None) -> MemoryReport:
        """The per-axis prediction of ``config`` (a full estimate for an optimizer-in-backward, or if one
        was already made).

        With ``limit_bytes``, the model-side run stops once more than that, less the smallest state of
        :attr:`reserve_optimizers`, is alive: the report's peak is then a lower bound above the limit
        (``report.meta["method"] == "lower bound"``).
        """
        if config in self._full or config.optimizer.in_backward:
            return self.full(config)
        probe, limit = self._probe(config, limit_bytes)
        if probe.stopped_at is not None or (limit is not None and probe.peak_bytes > limit):
            # the model side plus the smallest optimizer state is over the limit: no optimizer fits, and none
            # is profiled for it (a low-bit one imports torchao); the figure is a lower bound above the limit
            reserved = (limit_bytes or 0) - (limit or 0)
            breakdown = dict(probe.peak_breakdown)
            breakdown["optimizer_state"] += reserved
            return self._report(probe.peak_bytes + reserved, breakdown, config, "lower bound")
        peak, breakdown = combine(probe, self._profile(config.optimizer, probe.trainable))
        return self._report(peak, breakdown, config, "per-axis")

    def model_side_fits(self, config: TrainingConfig, limit_bytes: int) -> bool:
        """Whether ``config``'s model side alone (no optimizer state) stays within ``limit_bytes``."""
        if config.optimizer.in_backward:
            return self.predict(config).peak_bytes <= limit_bytes
        probe, limit = self._probe(config, limit_bytes)
        return probe.stopped_at is None and limit is not None and probe.peak_bytes <= limit

    def model_side_over(self, config: TrainingConfig, limit_bytes: int) -> bool:
        """Whether ``config`` provably cannot fit ``limit_bytes``: its model side (plus the smallest optimizer state
        of :attr:`reserve_optimizers`) passes the limit before backward starts. Runs at most the forward (a run
        already made answers at once); ``False`` means only "not proven": it may still pass the limit later. On a
        model of alike blocks (``planning/_depth.py``) the forwards run are those of two shallow copies, whose
        secant bounds the full depth's forward from below: no full-depth run at all.
        """
        if config.optimizer.in_backward:
            return self.predict(config, limit_bytes).peak_bytes > limit_bytes
        key = model_side_key(config)
        limit = limit_bytes - self._reserve(config)
        if key in self._failed:
            raise self._failed[key]
        cached = self._probes.get(key)
        if cached is not None and cached.stopped_at is None:
            return cached.peak_bytes > limit  # a complete run
        if cached is not None and limit <= cached.stopped_at:
            return True  # already proven above this limit
        if key in self._forward_peaks:
            return self._forward_peaks[key] > limit  # its whole forward already ran
        weights = self._weight_bytes(config)
        if weights is not None and weights > limit:
            return True  # its weights alone pass the limit
        if self._depth_free(config):  # two shallow copies' forwards: over the limit, or not proven (no full-depth run)
            return self._depth_over(config, limit, backward=False) is not None
        probe, _ = self._probe(config, limit_bytes, forward_only=True)
        if probe.forward_only:
            self._forward_peaks[key] = probe.peak_bytes
            return False
        return True

    def full(self, config: TrainingConfig) -> MemoryReport:
        """The full :func:`estimate_memory` of ``config`` (cached)."""
        if config in self._failed:
            raise self._failed[config]
        if config not in self._full:
            self.full_estimates += 1
            try:
                report = estimate_memory(
                    self.module,
                    self.batch,
                    loss_fn=self.user_loss_fn,
                    device=self.device,
                    config=config.replace(optimizer=self._optimizer(config.optimizer)),
                    loop=self.loop,
                    attention_kernel=self.attention_kernel,
                    accumulate_grad_batches=self.accumulate,
                    gpu=self.card,
                )
            except (ImportError, RuntimeError, ValueError, NotImplementedError) as err:
                self._failed[config] = err  # asked again (the search, the message), it fails the same way
                raise
            report.meta["method"] = "full"
            self._full[config] = report
        return self._full[config]

    # ------------------------------------------------------------------ the per-axis parts
    def _probe(
        self, config: TrainingConfig, limit_bytes: int | None, forward_only: bool = False
    ) -> tuple[ModelProbe, int | None]:
        """The model-side run of ``config`` and the limit its model side alone must stay within: ``limit_bytes``
        less the smallest state of :attr:`reserve_optimizers` (known once its precision / LoRA ran once).
        ``forward_only``: a run that reaches backward below the limit stops there, and is not kept."""
        key = model_side_key(config)  # the model-side axes of planning/axes.py
        limit = None if limit_bytes is None else limit_bytes - self._reserve(config)
        if key in self._failed:
            raise self._failed[key]  # this model side cannot be built: no need to apply it again
        cached = self._probes.get(key)
        if cached is not None and (cached.stopped_at is None or (limit is not None and limit <= cached.stopped_at)):
            return cached, limit  # complete, or already proven above this limit
        weights = self._weight_bytes(config)
        if limit is not None and weights is not None and weights > limit:
            # its weights alone pass the limit (an 8B model's float32 weights on a 24 GB card): no run needed
            breakdown = dict.fromkeys(CATEGORIES, 0)
            breakdown["parameters"] = weights
            return ModelProbe(weights, breakdown, 0, dict.fromkeys(CATEGORIES, 0), (), limit), limit
        bound = self._depth_over(config, limit, backward=True) if limit is not None else None
        if bound is not None:  # the secant of two shallow copies passes it: no full-depth run
            return ModelProbe(bound[0], bound[1], 0, dict.fromkeys(CATEGORIES, 0), (), limit), limit
        self.probes += 1
        deep = None if forward_only else self._deeper(config, limit)
        if deep is not None:  # the full depth's figures from two shallow copies' steps: no full-depth run
            self._probes[key] = deep
            self._trainable[(config.precision, config.lora)] = deep.trainable
            return deep, limit
        try:
            with data_dependent_errors_explained(self.module, config, steps=2):
                probe = probe_model(
                    self.module,
                    self.batch,
                    config,
                    loss_fn=self.loss_fn,
                    device=self.device,
                    loop=self.loop,
                    limit_bytes=limit,
                    attention_kernel=self.attention_kernel,
                    forward_only=forward_only,
                    accumulate=self.accumulate,
                )
        except (ImportError, RuntimeError, ValueError, NotImplementedError) as err:
            self._failed[key] = err
            raise
        self._trainable[(config.precision, config.lora)] = probe.trainable
        if probe.forward_only:
            return probe, limit  # says only that the forward stayed below the limit: not a model side to reuse
        self._probes[key] = probe
        self._trainable[(config.precision, config.lora)] = probe.trainable
        return probe, limit

    def _depth_free(self, config: TrainingConfig) -> bool:
        """Whether the secant bound of ``planning/_depth.py`` holds for ``config`` on this model."""
        from lightning_lowmem.planning._depth import depth_free, depth_stack

        if self._stack is False:
            self._stack = depth_stack(self.module)
        return self._stack is not None and depth_free(config)

    def _depth_over(self, config: TrainingConfig, limit: int, backward: bool) -> tuple[int, dict[str, int]] | None:
        """A lower bound of ``config``'s model-side peak that passes ``limit`` (with its breakdown), from two shallow
        copies of the model: their forwards first (cheap: no backward), then, with ``backward``, their whole steps
        (see :data:`WHOLE_STEP_FROM`); ``None`` when neither passes it, or the bound does not hold here."""
        if not self._depth_free(config):
            return None
        bound = self._depth_bound(config, whole_step=False)
        if bound is None or bound[0] > limit:
            return bound
        if backward and bound[0] >= WHOLE_STEP_FROM * limit:  # else the full-depth run it would save follows anyway
            bound = self._depth_bound(config, whole_step=True)
            if bound is not None and bound[0] > limit:
                return bound
        return None

    def _depth_bound(self, config: TrainingConfig, whole_step: bool) -> tuple[int, dict[str, int]] | None:
        """The secant bound of ``config``'s model-side peak (``whole_step``) or of its forward's peak (a lower one),
        with its breakdown, cached by model side; ``None`` if a shallow copy failed (the full-depth run then says
        why)."""
        from lightning_lowmem.planning._depth import DEPTHS, one_block_fewer, secant_bound

        key = (model_side_key(config), whole_step)
        if key not in self._depth_bounds:
            peaks = []
            try:
                for depth in reversed(DEPTHS):
                    # a forward of the deeper copy, cut where its blocks start, also tells the shallower one's
                    path = self._stack.path
                    cut = None if whole_step else Cuts((f"{path}.1", f"{path}.{depth - 1}"), f"{path}.{depth - 1}")
                    probe = self._shallow_probe(config, depth, whole_step, cut)
                    self.depth_bounds += 1
                    peaks.insert(0, (probe.peak_bytes, probe.peak_breakdown))
                    if probe.segments is not None:
                        peaks.insert(0, one_block_fewer(probe.segments))
                        break
            except Exception:  # noqa: BLE001 - no bound; the full-depth run raises what the search expects
                peaks = []
            self._depth_bounds[key] = secant_bound(peaks[0], peaks[1], self._stack.depth) if peaks else None
        return self._depth_bounds[key]

    def _shallow_probe(self, config: TrainingConfig, depth: int, whole_step: bool, cut: Any) -> ModelProbe:
        return probe_model(
            self._stack.shallow(self.module, depth),
            self.batch,
            config,
            loss_fn=self.loss_fn,
            device=self.device,
            loop=self.loop,
            attention_kernel=self.attention_kernel,
            forward_only=not whole_step,
            accumulate=self.accumulate,
            cut_at=cut,
        )

    def _deeper(self, config: TrainingConfig, limit: int | None) -> ModelProbe | None:
        """``config``'s full-depth model side from whole steps of the copies of 3 and 4 blocks (``planning/_depth.py``:
        :func:`~lightning_lowmem.planning._depth.deeper_step` from the first, checked on the second), or ``None``: not
        a model and step it applies to (torch's loop, one batch per step, alike blocks), the check failed, or the run
        would pass ``limit`` (the full-depth run then stops where it passes it, as the search expects)."""
        from lightning_lowmem.planning._depth import DEPTHS, deeper_step, step_cuts

        if self.loop != "torch" or self.accumulate != 1 or config.microbatch is not None:
            return None
        if not self._depth_free(config):
            return None
        try:
            copy = self._shallow_probe(config, DEPTHS[1], True, step_cuts(self._stack.path))
            check = self._shallow_probe(config, DEPTHS[1] + 1, True, None)
        except Exception:  # noqa: BLE001 - the full-depth run raises what the search expects
            return None
        self.depth_bounds += 2
        if deeper_step(copy, DEPTHS[1] + 1) != check:
            return None  # one block more than the copy is not what the segments say: run the full depth
        deep = deeper_step(copy, self._stack.depth)
        if deep is None or (limit is not None and deep.peak_bytes > limit):
            return None
        return deep

    def _weight_bytes(self, config: TrainingConfig) -> int | None:
        """A lower bound of ``config``'s model side: its weights in the precision's dtype (adapters left out), or
        ``None`` where a technique changes what the weights hold (a quantized base, QAT, pruning...)."""
        lora = config.lora
        if lora is not None and (lora.quantize_base is not None or lora.quantize_frozen):
            return None
        if any(value is not None for field, value in config.configs().items() if field not in _WEIGHTS_KEPT):
            return None
        if self._parameter_count is None:
            floating = [p for p in self.module.parameters() if p.is_floating_point()]
            self._parameter_count = (
                sum(p.numel() for p in floating),
                sum(p.numel() * p.element_size() for p in self.module.parameters() if not p.is_floating_point()),
            )
        count, other = self._parameter_count
        dtype = config.precision.true_dtype or torch.float32
        return count * dtype.itemsize + other

    def _reserve(self, config: TrainingConfig) -> int:
        """The smallest optimizer state a candidate with ``config``'s model side keeps through its step."""
        trainable = self._trainable.get((config.precision, config.lora))
        names = [name for name in self.reserve_optimizers if not name.endswith("_in_backward")]
        if trainable is None or not names or any((name, trainable) not in self._profiles for name in names):
            return 0  # profiled when the search first predicts them (a low-bit one imports torchao: seconds)
        return min(self._profiles[(name, trainable)].state_bytes for name in names)

    def _optimizer(self, optimizer: OptimizerConfig) -> OptimizerConfig:
        """The optimizer a candidate's step runs: its config, completed with the hyperparameters asked for."""
        given = self.optimizer_kwargs(optimizer.name)
        if not given or given.items() <= optimizer.kwargs.items():
            return optimizer
        return OptimizerConfig(optimizer.name, {**given, **optimizer.kwargs})

    def _profile(self, optimizer: OptimizerConfig, trainable: Any) -> OptimizerProfile:
        name = optimizer.name
        key = (name, trainable) if not optimizer.hyperparameters else (name, optimizer.hyperparameters, trainable)
        if key not in self._profiles:
            self.profiles += 1
            kwargs = device_optimizer_kwargs(name, self.device, self._optimizer(optimizer).kwargs)
            self._profiles[key] = profile_optimizer(name, trainable, device=self.device, kwargs=kwargs)
        return self._profiles[key]

    def _report(self, peak: int, breakdown: dict[str, int], config: TrainingConfig, method: str) -> MemoryReport:
        report = MemoryReport(
            peak_bytes=peak,
            breakdown=breakdown,
            device=self.device,
            source="estimated",
            meta={"config": config.to_dict(), "label": config.describe(), "loop": self.loop, "method": method},
        )
        return on_card(report, self.device, self.card)
