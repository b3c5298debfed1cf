"""Dispatch-level accounting of live tensor storages, split into categories and phases.

Every op passes through :class:`StorageTracker` (a ``TorchDispatchMode``). Each storage the op creates
is recorded with its byte size and a category, and a weak reference tells us when it is freed. The
running total's maximum is the peak; a snapshot of the category totals is kept at that moment.

A storage's category is often learnt *after* it was allocated (a gradient becomes a gradient when
autograd assigns it to ``.grad``; optimizer state when ``step()`` returns). Relabelling therefore also
corrects every snapshot taken while the storage was alive, so the breakdown at the peak is exact.
The same holds for storages that existed before tracking began and are first seen later.

Any dispatch mode makes autograd add two gradients of one tensor out of place, where a run without a mode adds
in place; the tracker books such sums as the run without it makes them (``_accumulation.py``).

``other`` (neither model / optimizer state nor saved for backward) is split by where each storage was made, at
the peak and at each phase's peak: ``_origins.py`` names the kinds (:data:`OTHER_KINDS`) and tells them apart.

``torch.compile`` cannot trace a region while a user ``TorchDispatchMode`` is active (dynamo skips the
frame; with ``fullgraph=True``, as torchao's 8/4-bit optimizers use for their per-parameter step, it
raises). The tracker therefore sets the compiler stance to ``"force_eager"`` while it runs: compiled
functions run as plain eager code, so every op and every optimizer-state tensor is seen. Eager code
may hold intermediates a fused kernel would not, so a compiled region's transient peak can read a
little high; state, gradients and parameters are exact.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from lightning_lowmem._compat.autograd import in_backward, move_post_accumulate_grad_hook_first, observing_saved_tensors
from lightning_lowmem._compat.compiler import force_eager
from lightning_lowmem._compat import TorchDispatchMode
from lightning_lowmem.memory._accumulation import EngineSums, first_of_engine_sum
from lightning_lowmem.memory._module_peaks import ModulePeaks
from lightning_lowmem.memory._origins import OTHER_KINDS, Origins, nonzero_kinds
from lightning_lowmem.memory._segments import SegmentPeaks
from lightning_lowmem.memory._tensors import is_parameter, is_plain, iter_tensors, op_tensors, optimizer_state_tensors
from lightning_lowmem.memory._tensors import plain_tensors
from lightning_lowmem.memory._unseen import UnseenAllocations
from lightning_lowmem.memory.report import CATEGORIES, PHASES, MemoryReport

_ACTIVE: list["StorageTracker"] = []


@dataclass
class _Record:
    nbytes: int
    category: str
    seq: int  # allocation sequence number; 0 = existed before tracking began
    phase: str
    kind: str = "inputs"  # where it was made (OTHER_KINDS): what it is while its category is "other"


@dataclass
class _Snapshot:
    total: int = 0
    seq: int = 0
    breakdown: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    other: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OTHER_KINDS, 0))


class MemoryLimitExceeded(RuntimeError):
    """Raised by a tracker with ``limit_bytes`` as soon as the live bytes pass the limit."""


class PhaseReached(RuntimeError):
    """Raised by a tracker with ``stop_before_phase`` when that phase's first op is about to run."""


class StorageTracker(EngineSums, UnseenAllocations, TorchDispatchMode):
    """Counts live storages on one device type, by category and phase. Use via ``track_memory``.

    Args:
        device: ``"cpu"`` or ``"cuda"``: only storages of this device type are counted.
        modules: modules whose parameters/buffers are ``parameters`` and whose ``.grad`` are
            ``gradients``; also used to name modules in ``by_module``.
        optimizers: optimizers whose ``state`` is ``optimizer_state``. Any optimizer that steps while
            tracking is found automatically too.
        round_bytes: maps a storage's byte size to the bytes the device allocator books for it.
        by_module: record per-module forward peaks (costs a little per module call).
    """

    def __init__(
        self,
        device: str = "cpu",
        modules: Iterable[nn.Module] = (),
        optimizers: Iterable[Any] = (),
        round_bytes: Callable[[int], int] | None = None,
        by_module: bool = True,
    ) -> None:
        super().__init__()
        self.device = device
        self.modules = [m for m in modules if m is not None]
        self.optimizers = [o for o in optimizers if o is not None]
        self.round_bytes = round_bytes or (lambda n: n)
        self.track_modules = by_module
        self._records: dict[int, _Record] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._current = dict.fromkeys(CATEGORIES, 0)
        self._current_other = dict.fromkeys(OTHER_KINDS, 0)  # the "other" bytes by kind
        self._total = 0
        self._seq = itertools.count(1)
        self._last_seq = 0
        self._peak = _Snapshot()
        self._phase_peaks: dict[str, _Snapshot] = {}
        self._phase = "forward"
        self._last_phase = "forward"
        self._forward_keys: list[tuple[int, int]] = []  # (key, seq) of what forward allocated
        self._hooked_params: dict[int, Any] = {}
        self._handles: list[Any] = []
        self._module_names: dict[int, str] = {}
        self.origins = Origins(self._module_names)  # the kind of each "other" allocation
        self._module_peaks = ModulePeaks(self._module_names)  # by_module
        self.segments = SegmentPeaks(self)  # figures per segment of the run, once cut (``cut_at``)
        self.limit_bytes: int | None = None  # raise MemoryLimitExceeded once live bytes pass it
        self.stop_before_phase: str | None = None  # raise PhaseReached when this phase starts (e.g. "backward")
        self._stopped = True  # not observing (yet): set False when __enter__ has set everything up
        self._backend_depth = 0  # > 0 inside a collective: storages first seen then were made by the backend
        self._held_sum: tuple[int, int, int] | None = None  # autograd's sum not yet counted: its key, first's, bytes
        self._callback_error: Exception | None = None  # raised in a weakref callback (the limit): the next op raises
        self.report: MemoryReport | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "StorageTracker":
        for module in self.modules:
            for name, sub in module.named_modules():
                self._module_names.setdefault(id(sub), name)
            for param in module.parameters():
                self.mark(param, "parameters")  # opens tensor subclasses (e.g. quantized weights)
                self._hook_param(param)
            for buffer in module.buffers():
                self.mark(buffer, "parameters")
        for optimizer in self.optimizers:
            self._label_optimizer(optimizer)
        self._handles.append(register_optimizer_step_pre_hook(self._on_step_pre))
        self._handles.append(register_optimizer_step_post_hook(self._on_step_post))
        self._handles.append(nn.modules.module.register_module_forward_pre_hook(self._on_module_pre))
        self._handles.append(nn.modules.module.register_module_forward_hook(self.origins.exit))
        if self.track_modules and self._module_names:
            self._handles.append(nn.modules.module.register_module_forward_hook(self._on_module_post))
        # observe saved tensors, passing each on to the hooks below (e.g. activation compression entered first)
        self._saved_hooks = observing_saved_tensors(self._on_pack)
        self._saved_hooks.__enter__()
        # compiled regions cannot run under a dispatch mode: run them eagerly (see module docstring)
        self._eager_stance = force_eager()
        self._eager_stance.__enter__()
        _ACTIVE.append(self)
        self._stopped = False
        return super().__enter__()

    def stop(self) -> None:
        """Stop observing now; the report is built when the ``with`` block exits.

        For a tracking window that must end inside a hook where the global hooks cannot be removed (an
        optimizer step post-hook): the dispatch mode and saved-tensor hooks leave their stacks now, in
        the order they entered; storages freed afterwards still update the counters (not the peaks), and
        labels learnt at exit (optimizer state) still correct the snapshots.
        """
        if self._stopped:
            return
        self._count_held_sum()
        self._stopped = True
        try:
            super().__exit__(None, None, None)
        finally:
            _ACTIVE.remove(self)
            self._eager_stance.__exit__(None, None, None)
            self._saved_hooks.__exit__(None, None, None)

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        finally:
            for optimizer in self.optimizers:
                self._label_optimizer(optimizer)
            for handle in itertools.chain(self._handles, self._hooked_params.values()):
                handle.remove()
            self._handles.clear()
            self._hooked_params.clear()
            self.report = self._build_report()
            # drop weak references so no callback fires into a finished tracker
            self._refs.clear()

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self._count_held_sum()
        if self._callback_error is not None:
            error, self._callback_error = self._callback_error, None
            raise error
        phase = self._phase_now()
        if phase != self._phase:
            self._enter_phase(phase)
        records = self._records
        for tensor in op_tensors(args, kwargs):
            key = self._key(tensor)
            if key is None:
                continue
            is_param = is_parameter(tensor)
            record = records.get(key)
            if record is None:
                self._see(tensor, "parameters" if is_param else "other")
            elif is_param and record.category == "other":
                self._relabel(key, "parameters")
            if is_param:
                self._hook_param(tensor)
        first = first_of_engine_sum(func, args, kwargs, sys._getframe(1)) if phase == "backward" else None
        out = func(*args, **kwargs)
        if first is not None and self._hold_sum(out, first):
            return out
        if isinstance(out, torch.Tensor):
            self._allocate_all(plain_tensors(out) if not is_plain(out) else (out,))
        else:
            self._allocate_all(iter_tensors(out))
        return out

    def _allocate_all(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            self._allocate(tensor)

    # ------------------------------------------------------------------ public helpers
    def mark(self, tensor: torch.Tensor, category: str) -> None:
        """Label the storage(s) behind ``tensor`` as ``category`` (see :func:`mark_memory`)."""
        self._count_held_sum()
        for plain in plain_tensors(tensor):
            key = self._key(plain)
            if key is None:
                continue
            if key not in self._records:
                self._see(plain, category)
            else:
                self._relabel(key, category)

    @property
    def current_bytes(self) -> int:
        self._count_held_sum()
        return self._total

    @property
    def peak_bytes(self) -> int:
        self._count_held_sum()
        return self._peak.total

    @property
    def current_breakdown(self) -> dict[str, int]:
        """Bytes live right now, per category (labels learnt later are not applied to this copy)."""
        return dict(self._current)

    # ------------------------------------------------------------------ internals
    def _key(self, tensor: torch.Tensor) -> int | None:
        if tensor.device.type != self.device:
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / nested / exotic layouts
            return None
        key = id(storage)
        if key not in self._refs:
            self._refs[key] = weakref.ref(storage, self._freed_callback(key))
        return key

    def _freed_callback(self, key: int) -> Callable[[Any], None]:
        def freed(_: Any) -> None:
            if self._held_sum is not None:
                if self._held_sum[1] == key:  # autograd's last reference to the first gradient: it adds in place
                    self._sum_in_place()
                    return
                self._count_held_sum(in_callback=True)
            record = self._records.pop(key, None)
            self._refs.pop(key, None)
            if record is not None:
                self._current[record.category] -= record.nbytes
                if record.category == "other":
                    self._current_other[record.kind] -= record.nbytes
                self._total -= record.nbytes

        return freed

    def _storage_bytes(self, tensor: torch.Tensor) -> int:
        return self.round_bytes(tensor.untyped_storage().nbytes())

    def _allocate(self, tensor: torch.Tensor) -> None:
        key = self._key(tensor)
        if key is not None:
            self._allocate_bytes(key, self._storage_bytes(tensor))

    def _allocate_bytes(self, key: int, nbytes: int) -> None:
        record = self._records.get(key)
        if record is not None:
            if nbytes != record.nbytes:  # resize_ and friends
                delta = nbytes - record.nbytes
                record.nbytes = nbytes
                self._current[record.category] += delta
                if record.category == "other":
                    self._current_other[record.kind] += delta
                self._total += delta
                self._update_peaks(next(self._seq))
            return
        seq = next(self._seq)
        kind = self.origins.kind_now(self._phase)
        self._records[key] = _Record(nbytes, "other", seq, self._phase, kind)
        self._current["other"] += nbytes
        self._current_other[kind] += nbytes
        self._total += nbytes
        if self._phase == "forward":
            self._forward_keys.append((key, seq))
        self._update_peaks(seq)

    def _see(self, tensor: torch.Tensor, category: str) -> None:
        """Register a storage that existed before tracking (or was made where we could not see)."""
        key = self._key(tensor)
        if key is None or key in self._records:
            if key is not None:
                self._relabel(key, category)
            return
        if self._backend_depth and not self._stopped:  # made during a collective, not before tracking
            self._allocate(tensor)
            self._relabel(key, category)
            return
        nbytes = self._storage_bytes(tensor)
        self._records[key] = _Record(nbytes, category, 0, "forward")
        self._current[category] += nbytes
        if category == "other":
            self._current_other["inputs"] += nbytes
        self._total += nbytes
        for snap in self._snapshots():  # it was alive at every snapshot taken so far
            snap.total += nbytes
            snap.breakdown[category] += nbytes
            if category == "other":
                snap.other["inputs"] += nbytes
        self._module_peaks.seen_late(nbytes)
        if self._total > self._peak.total:
            self._update_peaks(self._last_seq)

    def _relabel(self, key: int, category: str) -> None:
        record = self._records[key]
        old = record.category
        if old == category:
            return
        record.category = category
        self._current[old] -= record.nbytes
        self._current[category] += record.nbytes
        for other, sign in ((old, -1), (category, 1)):
            if other == "other":
                self._current_other[record.kind] += sign * record.nbytes
        for snap in self._snapshots():
            if record.seq <= snap.seq:  # alive when the snapshot was taken: correct it
                snap.breakdown[old] -= record.nbytes
                snap.breakdown[category] += record.nbytes
                if old == "other":
                    snap.other[record.kind] -= record.nbytes
                elif category == "other":
                    snap.other[record.kind] += record.nbytes

    def _snapshots(self) -> Iterator[_Snapshot]:
        yield self._peak
        yield from self._phase_peaks.values()
        yield from self.segments.snapshots()

    def _snapshot_now(self, seq: int | None) -> _Snapshot:
        seq = self._last_seq if seq is None else seq
        return _Snapshot(self._total, seq, dict(self._current), dict(self._current_other))

    def _update_peaks(self, seq: int) -> None:
        self._last_seq = seq
        if self._total > self._peak.total:
            self._peak = _Snapshot(self._total, seq, dict(self._current), dict(self._current_other))
            if self.limit_bytes is not None and self._total > self.limit_bytes and not self._stopped:
                raise MemoryLimitExceeded(f"live bytes {self._total} passed the limit {self.limit_bytes}")
        phase_peak = self._phase_peaks.get(self._phase)
        if phase_peak is None or self._total > phase_peak.total:
            self._phase_peaks[self._phase] = _Snapshot(self._total, seq, dict(self._current), dict(self._current_other))
        self._module_peaks.peak(self._total)
        self.segments.peak(self._total, seq)

    def _phase_now(self) -> str:
        if in_backward():
            return "backward"
        if self._last_phase in ("backward", "optimizer"):
            return "optimizer"  # after backward, until a module forward starts or a step ends
        return "forward"

    def _enter_phase(self, phase: str) -> None:
        if phase == self.stop_before_phase and not self._stopped:
            raise PhaseReached(f"stopped before {phase}, with {self._total} bytes live")
        if self._phase == "forward" and phase == "backward":
            # what forward allocated and still holds is what backward needs: activations
            for key, seq in self._forward_keys:
                record = self._records.get(key)  # the same storage, not a later one at a freed one's address
                if record is not None and record.seq == seq and record.category == "other":
                    self._relabel(key, "activations")
            self._forward_keys.clear()
        elif phase == "forward":
            self._forward_keys.clear()
            self.origins.new_forward()
        self._phase = self._last_phase = phase
        if phase not in self._phase_peaks:
            self._phase_peaks[phase] = _Snapshot(
                self._total, self._last_seq, dict(self._current), dict(self._current_other)
            )

    def _on_pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._count_held_sum()
        key = self._key(tensor)
        if key is not None and key in self._records and self._records[key].category == "other":
            self._relabel(key, "activations")
        return tensor

    def _hook_param(self, param: torch.Tensor) -> None:
        if id(param) in self._hooked_params or not param.requires_grad:
            return
        if param.grad is not None:
            self.mark(param.grad, "gradients")
        handle = param.register_post_accumulate_grad_hook(self._on_grad)
        move_post_accumulate_grad_hook_first(param, handle)
        self._hooked_params[id(param)] = handle

    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.mark(param.grad, "gradients")

    def _label_optimizer(self, optimizer: Any) -> None:
        for tensor in optimizer_state_tensors(optimizer):
            self.mark(tensor, "optimizer_state")
        for group in getattr(optimizer, "param_groups", []):
            for param in group.get("params", []):
                if isinstance(param, torch.Tensor):
                    self.mark(param, "parameters")
                    self._hook_param(param)

    def _on_step_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._stopped:
            return
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)
            self._label_optimizer(optimizer)

    def _on_step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._stopped:
            return
        self._label_optimizer(optimizer)
        self._last_phase = "forward"

    def _on_module_pre(self, module: nn.Module, args: Any) -> None:
        self._count_held_sum()
        if self._stopped or in_backward():  # checkpoint recomputation: not a new forward
            return
        self._last_phase = "forward"  # a module forward starts the forward phase
        self.origins.enter(module)
        if self.segments.marks:
            self.segments.enter(self._module_names.get(id(module)))
        if self.track_modules:
            self._module_peaks.enter(module, self._total)

    def _on_module_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._module_peaks.exit(module, self._total)

    def _build_report(self) -> MemoryReport:
        phases = {
            phase: {"peak_bytes": snap.total, "breakdown": dict(snap.breakdown), "other": nonzero_kinds(snap.other)}
            for phase, snap in sorted(self._phase_peaks.items(), key=lambda kv: PHASES.index(kv[0]))
        }
        return MemoryReport(
            peak_bytes=self._peak.total,
            breakdown=dict(self._peak.breakdown),
            other_breakdown=nonzero_kinds(self._peak.other),
            device=self.device,
            phases=phases,
            by_module=self._module_peaks.report(),
            end_bytes=self._total,
        )


@contextlib.contextmanager
def tagged_allocations(kind: str) -> Iterator[None]:
    """Inside: what the running tracker sees allocated counts, while it is ``other``, as ``kind`` (one of
    :data:`OTHER_KINDS`, e.g. ``"activation packing"`` around a saved-tensor pack / unpack). Free without a tracker."""
    tracker = active_tracker()
    if tracker is None:
        yield
        return
    with tracker.origins.tagged(kind):
        yield


def active_tracker() -> StorageTracker | None:
    """The innermost tracker currently running, if any."""
    return _ACTIVE[-1] if _ACTIVE else None
