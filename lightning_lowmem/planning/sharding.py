"""Per-rank memory under data parallelism, for ``estimate_memory(..., world_size=N, sharding=...)``.

All in one process, without the N devices:

* ``"fsdp"``: the traced step *is* FSDP2. A fake process group of ``world_size`` ranks (torch's
  ``fake`` backend: collectives return without communicating) lets ``fully_shard`` shard the fake model
  as on rank 0 of the real run, so the memory core counts what FSDP really holds: the local shards
  (padded to ``ceil(dim0 / N)`` rows, the same on every rank), the all-gather buffers and unsharded
  parameters of the unit in flight and the one prefetched in backward, the root's parameters kept
  from forward to backward, the reduce-scatter input, sharded gradients and optimizer state, and
  unsharded activations.
* ``"ddp"``: the single-process step plus what DDP adds: with ``gradient_as_bucket_view`` (the
  ``lowmem_ddp`` default) the gradients live in DDP's buckets, allocated once and never freed, so
  every phase carries all of them.
* ``"zero1"``: as ``"ddp"``, with the optimizer state of the parameters ``ZeroRedundancyOptimizer``
  assigns to each rank (its greedy largest-first partition, replayed here), so ranks can differ.

The batch given to ``estimate_memory`` is one rank's batch. FSDP's storage resizes (how it frees
gathered parameters) are invisible to a dispatch mode; :func:`count_fsdp_resizes` makes the memory
core see them, for estimates and measurements alike.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Any, Iterator

import torch
from torch import nn

from lightning_lowmem.memory.report import CATEGORIES, MemoryReport

__all__ = ["SHARDINGS", "ShardedStep", "count_fsdp_resizes", "group_ranks", "zero_partition"]

SHARDINGS = ("ddp", "zero1", "fsdp")
_FORWARD_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def _notify_tracker(tensor: torch.Tensor) -> None:
    from lightning_lowmem.memory._tracker import active_tracker

    tracker = active_tracker()
    if tracker is not None:
        tracker.resized(tensor)


_GLOO_COPIES: list[bool] = [False]  # set while an estimate simulates a gloo (CPU) run


@contextlib.contextmanager
def _collective(kind: str, output: torch.Tensor, input: torch.Tensor) -> Iterator[None]:
    """Around each FSDP collective: what the backend holds during the call, in a real run and an estimate.

    Gloo (``ProcessGroupGloo``, CPU) works on buffers of its own, in its worker threads, for the length of the
    call (FSDP2 waits at once: its all-gathers and reduce-scatters are synchronous here), as measured with
    ``torch.profiler``: a reduce-scatter reduces a copy of its whole input (the unit's unsharded gradients)
    and copies this rank's chunk out of it on ``wait``, where the tracker first sees it (counted from then:
    ``StorageTracker.backend_allocations``); an all-gather stages the output's size in a buffer no tensor op
    ever shows (counted for the call: ``StorageTracker.unseen_bytes``). The fake process group of an estimate
    communicates nothing, so there the same buffers are allocated for the same time. NCCL works in place.
    """
    from lightning_lowmem._compat import FakeTensor

    from lightning_lowmem.memory._tracker import active_tracker

    tracker = active_tracker()
    held, unseen = None, 0
    if _GLOO_COPIES[0] and isinstance(input, FakeTensor):  # an estimate of a gloo run
        held = torch.empty_like(input if kind == "reduce_scatter" else output)  # noqa: F841 - held for the call
    elif kind == "all_gather" and output.device.type == "cpu" and not isinstance(output, FakeTensor):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() > 1:
            unseen = output.untyped_storage().nbytes()
    with contextlib.ExitStack() as stack:
        if tracker is not None:
            stack.enter_context(tracker.backend_allocations())
            stack.enter_context(tracker.unseen_bytes(unseen))
        yield
    del held


def count_fsdp_resizes() -> None:
    """Make the memory core see what FSDP2 allocates outside tensor ops: gathered parameters (in-place
    storage resizes) and the communication backend's buffers (see ``StorageTracker.backend_allocations``)."""
    from lightning_lowmem._compat.distributed import around_fsdp_collectives, on_fsdp_storage_resize

    on_fsdp_storage_resize(_notify_tracker)
    around_fsdp_collectives(_collective)


def check_sharding(world_size: Any, sharding: Any) -> str | None:
    """Validate ``world_size`` / ``sharding``; returns the sharding (``"ddp"`` when only ``world_size > 1``).

    Raises:
        ValueError: ``world_size`` not an int >= 1; ``sharding`` not one of :data:`SHARDINGS` or ``None``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"`world_size`={world_size!r} must be an int >= 1: the number of processes (GPUs) the step runs on, "
            "e.g. world_size=8, sharding='fsdp'"
        )
    if sharding is not None and sharding not in SHARDINGS:
        close = difflib.get_close_matches(str(sharding), SHARDINGS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"`sharding`={sharding!r} is unknown; choose None, 'ddp', 'zero1' or 'fsdp'.{hint}")
    if sharding is None and world_size > 1:
        return "ddp"
    return sharding


def zero_partition(numels: list[list[int]], world_size: int) -> list[list[tuple[int, int]]]:
    """``ZeroRedundancyOptimizer``'s partition: per rank, the ``(group, index)`` of the parameters it owns.

    Within each param group, parameters are taken largest first and each goes to the rank with the
    fewest elements so far (the running sizes carry over between groups).
    """
    owned: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    sizes = [0] * world_size
    for group, group_numels in enumerate(numels):
        for index in sorted(range(len(group_numels)), key=lambda i: group_numels[i], reverse=True):
            rank = sizes.index(min(sizes))
            owned[rank].append((group, index))
            sizes[rank] += group_numels[index]
    return owned


def group_ranks(per_rank: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Ranks with the same figures as one entry: ``(ranks, figures)``, ranks written as ranges (``"0-7"``), in
    the order of each group's first rank. FSDP's padded shards give every rank the same figures; ZeRO-1's
    partition can give a few distinct ones.

    Args:
        per_rank: ``report.meta["per_rank"]`` of a sharded estimate: ``{"rank", "peak_bytes", "breakdown"}``.

    Returns:
        One ``(ranks, {"peak_bytes", "breakdown"})`` per distinct figure.

    Example::

        >>> same, other = {"peak_bytes": 10, "breakdown": {"parameters": 10}}, {"peak_bytes": 12, "breakdown": {}}
        >>> [ranks for ranks, _ in group_ranks([{"rank": r, **f} for r, f in enumerate([same, same, other, same])])]
        ['0-1, 3', '2']
    """
    groups: dict[tuple[int, tuple[tuple[str, int], ...]], list[int]] = {}
    figures: dict[tuple[int, tuple[tuple[str, int], ...]], dict[str, Any]] = {}
    for rank in per_rank:
        key = (rank["peak_bytes"], tuple(sorted(rank["breakdown"].items())))
        groups.setdefault(key, []).append(rank["rank"])
        figures.setdefault(key, {"peak_bytes": rank["peak_bytes"], "breakdown": dict(rank["breakdown"])})
    return [(_ranges(ranks), figures[key]) for key, ranks in groups.items()]


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


class ShardedStep:
    """What ``estimate_memory`` does differently for a sharded step: set up, shard, then per-rank figures.

    Args:
        sharding: ``None``, ``"ddp"``, ``"zero1"`` or ``"fsdp"``.
        world_size: number of processes. Default: 1.
        wrap_policy: FSDP units, as ``LowMemoryFSDPStrategy(wrap_policy=...)``. Default: ``"auto"``.
        reshard_after_forward: as the strategy's. Default: ``True``.
        device: the device type the ranks run on: ``"cpu"`` simulates gloo (its reduce-scatter copies its
            input), ``"cuda"`` NCCL. Default: ``"cuda"``.
    """

    def __init__(
        self,
        sharding: str | None,
        world_size: int = 1,
        wrap_policy: Any = "auto",
        reshard_after_forward: bool = True,
        device: str = "cuda",
    ) -> None:
        self.sharding = check_sharding(world_size, sharding)
        self.device = device
        self.world_size = world_size
        self.wrap_policy = wrap_policy
        self.reshard_after_forward = reshard_after_forward
        self._mesh: Any = None
        self._owns_group = False

    @property
    def fsdp(self) -> bool:
        return self.sharding == "fsdp"

    def __enter__(self) -> "ShardedStep":
        if not self.fsdp:
            return self
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from lightning_lowmem._compat.distributed import fake_process_group_store

        if dist.is_initialized():
            from lightning_lowmem.planning._fake_step import EstimationError

            raise EstimationError(
                f"estimate_memory(sharding='fsdp', world_size={self.world_size}) simulates the ranks with a fake "
                f"process group, but this process already has one ({dist.get_backend()}, world size "
                f"{dist.get_world_size()}): estimate before torch.distributed.init_process_group, or in a separate "
                "process (e.g. `lowmem estimate --devices N --strategy fsdp`)."
            )
        dist.init_process_group("fake", store=fake_process_group_store(), rank=0, world_size=self.world_size)
        self._owns_group = True
        self._mesh = init_device_mesh("cpu", (self.world_size,))  # outside FakeTensorMode: real rank tensors
        count_fsdp_resizes()
        _GLOO_COPIES[0] = self.device == "cpu" and self.world_size > 1
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            _GLOO_COPIES[0] = False
            self._owns_group = False
            self._mesh = None

    def autocast_dtype(self, precision: str, default: torch.dtype | None) -> torch.dtype | None:
        """FSDP runs ``bf16-mixed`` through its ``MixedPrecisionPolicy`` (bf16 gathers), not autocast."""
        return None if self.fsdp and precision == "bf16-mixed" else default

    def shard(self, model: nn.Module, precision: str) -> None:
        """Inside FakeTensorMode, after the model techniques: ``fully_shard_`` as the strategy does (FSDP only)."""
        if not self.fsdp:
            return
        from lightning_lowmem.functional.fsdp import fully_shard_

        fully_shard_(
            model,
            self.wrap_policy,
            mesh=self._mesh,
            reshard_after_forward=self.reshard_after_forward,
            mixed_precision=precision if precision in ("bf16-mixed", "bf16-true", "16-true") else None,
            forward_methods=_FORWARD_METHODS,
        )

    def finish(self, report: MemoryReport, optimizer: Any) -> MemoryReport:
        """Per-rank figures into ``report`` (``meta["per_rank"]``); ``peak_bytes`` is the largest rank's."""
        if self.sharding is None:
            return report
        if self.fsdp:  # padded shards: every rank holds the same bytes as rank 0
            ranks = [{"peak_bytes": report.peak_bytes, "breakdown": dict(report.breakdown)}] * self.world_size
        else:
            ranks = self._data_parallel_ranks(report, optimizer)
            top = max(ranks, key=lambda r: r["peak_bytes"])
            report.peak_bytes, report.breakdown = top["peak_bytes"], dict(top["breakdown"])
        report.meta.update(
            world_size=self.world_size, sharding=self.sharding, per_rank=[{"rank": i, **r} for i, r in enumerate(ranks)]
        )
        return report

    def _data_parallel_ranks(self, report: MemoryReport, optimizer: Any) -> list[dict[str, Any]]:
        groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
        all_grads = sum(p.numel() * p.element_size() for g in groups for p in g)
        state = [[_state_bytes(optimizer.state.get(p, {})) for p in g] for g in groups]
        total_state = sum(map(sum, state)) or 1
        if self.sharding == "zero1" and self.world_size > 1:
            owned = zero_partition([[p.numel() for p in g] for g in groups], self.world_size)
            shares = [sum(state[g][i] for g, i in rank) / total_state for rank in owned]
        else:
            shares = [1.0] * self.world_size
        moments = [report.breakdown, *(p["breakdown"] for p in report.phases.values())]
        ranks = []
        for share in shares:
            best: dict[str, int] | None = None
            for moment in moments:  # buckets hold every gradient at every moment; ZeRO keeps a share of the state
                breakdown = dict(moment)
                breakdown["gradients"] = max(breakdown["gradients"], all_grads)
                breakdown["optimizer_state"] = round(breakdown["optimizer_state"] * share)
                if best is None or sum(breakdown.values()) > sum(best.values()):
                    best = breakdown
            assert best is not None
            ranks.append({"peak_bytes": sum(best[c] for c in CATEGORIES), "breakdown": best})
        return ranks


def _state_bytes(state: Any) -> int:
    from lightning_lowmem.memory._tensors import iter_tensors

    seen: dict[int, int] = {}
    for tensor in iter_tensors(state):
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        seen[id(storage)] = storage.nbytes()
    return sum(seen.values())
