"""The card as an input: ``estimate_memory(..., gpu="A100-40GB")``, ``plan_memory(gpu=...)``, ``lowmem estimate --gpu``.

A :class:`GpuCard` holds what a GPU family adds to a training step's tensors, each with its source:

* ``capacity_bytes``: the memory the card has, as ``nvidia-smi`` reports its total (``Memory-Usage``'s right-hand
  side, in MiB; ``torch.cuda.get_device_properties().total_memory`` reads the same), which is what users compare
  with. It is not the marketing figure: an A10G or an L4 ("24 GB") shows 23028 / 23034 MiB, an H100 80GB 81559 MiB,
  an H200 ("141 GB") 143771 MiB; only the A100s and the GeForce cards show their nominal GiB. Each figure is the
  total printed by ``nvidia-smi`` on that card in public logs (cloud instances' and users' READMEs; the same
  total across drivers), the table below names the card model they were read on.
* ``cuda_context_bytes``: the driver's CUDA context with the kernels a training step loads, outside the
  caching allocator (``nvidia-smi`` shows it, ``torch.cuda.memory_reserved`` does not). With lazy module
  loading (CUDA >= 11.7, torch's default) the context alone is ~300 MB (PyTorch issue #107667, a maintainer's
  reading; before 11.7, > 1 GB); a training step loads cuBLAS / cuDNN / fused-kernel modules on top. No
  per-family measurement was published that we could cite, so every family carries the package's 500 MiB.
* ``cublas_workspace_bytes``: the cuBLAS workspace torch allocates through the caching allocator on the first
  matmul (``CUBLAS_WORKSPACE_CONFIG``'s default in ``aten/src/ATen/cuda/CublasHandlePool.cpp``:
  ``:4096:8`` = 32 MiB on compute capability 9.0+ (Hopper, Blackwell), ``:4096:2:16:8`` = 8 MiB + 128 KiB
  before (the 8519680-byte block users see in ``torch.cuda.memory_snapshot()``, discuss.pytorch.org/t/178671)).
  cuBLASLt reuses that workspace (unified workspaces, pytorch/pytorch#145130 / #168175, the default from
  torch 2.11); torch 2.9 / 2.10 kept a second, persistent cuBLASLt workspace of 1 MiB, 4 MiB (sm80 with
  >= 24 GB) or 32 MiB (sm90+) (pytorch/pytorch#120925, #156495): :meth:`GpuCard.workspace_bytes`.

The estimate then reports, beside the tensors' peak (``torch.cuda.max_memory_allocated``), the caching
allocator's reserved peak (:mod:`lightning_lowmem.memory.cuda_allocator`) and what ``nvidia-smi`` would show
(reserved + context + workspace), and whether that fits the card (``report.meta["gpu"]``).
"""

from __future__ import annotations

import contextlib
import difflib
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightning_lowmem.memory.report import MemoryReport

__all__ = ["GPUS", "GpuCard", "gpu_names", "resolve_card"]

MiB = 2**20
GiB = 2**30
CUDA_CONTEXT_BYTES = 500 * MiB
"""The CUDA context + the kernels a training step loads, per process (module docstring)."""
DEFAULT_WORKSPACE_BYTES = 32 * MiB
"""The cuBLAS workspace without a card: Hopper's (the largest)."""


@dataclass(frozen=True)
class GpuCard:
    """One GPU family (module docstring for the sources).

    Args:
        name: as ``--gpu`` takes it, e.g. ``"A100-40GB"``.
        capacity_bytes: the card's memory.
        compute_capability: ``(major, minor)``, e.g. ``(8, 0)`` for A100.
        cuda_context_bytes: driver memory outside the caching allocator. Default: 500 MiB.
    """

    name: str
    capacity_bytes: int
    compute_capability: tuple[int, int]
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES

    device = "cuda"

    def workspace_bytes(self, torch_version: str | None = None) -> int:
        """cuBLAS (+ cuBLASLt) workspace bytes torch keeps on this card (module docstring), for ``torch_version``
        (default: the installed torch)."""
        hopper = self.compute_capability[0] >= 9
        cublas = 32 * MiB if hopper else 8 * MiB + 128 * 1024
        major, minor = (int(part) for part in (torch_version or torch.__version__).split(".")[:2])
        if (major, minor) >= (2, 11) or (major, minor) < (2, 9):  # unified with cuBLAS's / allocated per call
            return cublas
        lt = (
            32 * MiB
            if hopper
            else 4 * MiB
            if self.compute_capability[0] == 8 and self.capacity_bytes >= 24 * GiB
            else MiB
        )
        return cublas + lt


def _card(name: str, mib: int, capability: tuple[int, int]) -> GpuCard:
    return GpuCard(name, mib * MiB, capability)


GPUS: dict[str, GpuCard] = {
    card.name: card
    for card in (  # nvidia-smi's total in MiB, read on (module docstring):
        _card("T4", 15360, (7, 5)),  # Tesla T4
        _card("V100-16GB", 16160, (7, 0)),  # Tesla V100-SXM2-16GB, V100-PCIE-16GB
        _card("V100-32GB", 32510, (7, 0)),  # Tesla V100-SXM2-32GB, V100-PCIE-32GB
        _card("RTX3090", 24576, (8, 6)),  # NVIDIA GeForce RTX 3090
        _card("A10G", 23028, (8, 6)),  # NVIDIA A10G (AWS g5), the A10 the same
        _card("A100-40GB", 40960, (8, 0)),  # NVIDIA A100-SXM4-40GB, A100-PCIE-40GB
        _card("A100-80GB", 81920, (8, 0)),  # NVIDIA A100-SXM4-80GB
        _card("RTX4090", 24564, (8, 9)),  # NVIDIA GeForce RTX 4090
        _card("L4", 23034, (8, 9)),  # NVIDIA L4
        _card("L40S", 46068, (8, 9)),  # NVIDIA L40S
        _card("H100-80GB", 81559, (9, 0)),  # NVIDIA H100 80GB HBM3, H100 PCIe
        _card("H200", 143771, (9, 0)),  # NVIDIA H200, H200 NVL
    )
}
"""The known cards by name (capacities: ``nvidia-smi``'s totals; compute capabilities: NVIDIA's CUDA GPU list)."""


def gpu_names() -> list[str]:
    return list(GPUS)


def resolve_card(gpu: str | GpuCard | None, device: str = "cuda") -> GpuCard | None:
    """The :class:`GpuCard` named ``gpu`` (case and ``-`` / ``_`` / space insensitive), or ``None`` for none.

    Raises:
        ValueError: an unknown name (the message lists the known ones and the closest), or ``device="cpu"``
            beside a card.
    """
    if gpu is None:
        return None
    if device != "cuda":
        raise ValueError(
            f"`gpu`={gpu!r} is a CUDA card but `device`={device!r}; leave `device` out (a card implies 'cuda')"
        )
    if isinstance(gpu, GpuCard):
        return gpu
    wanted = _normal(str(gpu))
    for name, card in GPUS.items():
        if _normal(name) == wanted:
            return card
    close = [name for name in GPUS if _normal(name).startswith(wanted)] or [
        name
        for match in difflib.get_close_matches(wanted, map(_normal, GPUS), n=1)
        for name in GPUS
        if _normal(name) == match
    ]
    hint = f"did you mean {' or '.join(repr(name) for name in close)}? " if close else ""
    raise ValueError(f"`gpu`={gpu!r} is not a known card; {hint}known: {', '.join(GPUS)}")


def _normal(name: str) -> str:
    return name.upper().replace("-", "").replace("_", "").replace(" ", "").replace("NVIDIA", "")


# ----------------------------------------------------------------------------- the estimate on a card
def card_simulation(card: GpuCard | None, model: Any, optimizer: Any, batch: Any) -> Any:
    """For a card: an :class:`~lightning_lowmem.memory.cuda_allocator.AllocatorSimulation` of the step, with what
    lives before it (parameters, gradients, optimizer state, the batch) booked first; else a null context."""
    if card is None:
        return contextlib.nullcontext()
    from lightning_lowmem._compat import tree_leaves
    from lightning_lowmem.memory._tensors import optimizer_state_tensors
    from lightning_lowmem.memory.cuda_allocator import AllocatorSimulation

    params = list(model.parameters()) + list(model.buffers())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    batch_tensors = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    return AllocatorSimulation([*params, *grads, *optimizer_state_tensors(optimizer), *batch_tensors])


def card_overheads(card: GpuCard | None) -> int:
    """The CUDA context + cuBLAS workspace bytes of ``card`` (``None``: the package's defaults, 500 + 32 MiB)."""
    if card is None:
        return CUDA_CONTEXT_BYTES + DEFAULT_WORKSPACE_BYTES
    return card.cuda_context_bytes + card.workspace_bytes()


def on_card(report: MemoryReport, device: str, card: GpuCard | None, simulation: Any = None) -> MemoryReport:
    """``report`` with the CUDA overheads (the card's, else the package's defaults) and, for a card,
    ``meta["gpu"]``: allocated / reserved / ``nvidia-smi`` bytes and whether they fit the card."""
    if device != "cuda":
        return report
    if card is None:
        report.overheads = {"cuda_context": CUDA_CONTEXT_BYTES, "cublas_workspace": DEFAULT_WORKSPACE_BYTES}
        return report
    report.overheads = {"cuda_context": card.cuda_context_bytes, "cublas_workspace": card.workspace_bytes()}
    allocator = getattr(simulation, "allocator", None)
    reserved = max(allocator.peak_reserved_bytes, report.peak_bytes) if allocator is not None else report.peak_bytes
    smi = reserved + sum(report.overheads.values())
    report.device_stats = {**report.device_stats, "max_allocated": report.peak_bytes, "max_reserved": reserved}
    report.meta["gpu"] = {
        **asdict(card),
        "allocated_bytes": report.peak_bytes,
        "reserved_bytes": reserved,
        "nvidia_smi_bytes": smi,
        "fits": smi <= card.capacity_bytes,
    }
    return report
