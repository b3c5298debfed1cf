"""The CUDA caching allocator's memory-snapshot tool.

Each function names the private name it uses (of torch, Lightning, transformers or torchao) and why no public
API does the job.
"""

from __future__ import annotations

import torch

__all__ = ["cuda_dump_snapshot", "cuda_record_memory_history"]


def cuda_record_memory_history(enabled: bool, max_entries: int = 100_000) -> None:
    """Start / stop the CUDA caching allocator's history recording (for OOM snapshots).

    Why private: ``torch.cuda.memory._record_memory_history`` is the documented entry point of the
    memory-snapshot tool (pytorch.org "Understanding CUDA Memory Usage") but keeps its underscore.
    """
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def cuda_dump_snapshot(path: str) -> None:
    """Write the recorded CUDA allocator history to ``path`` (see :func:`cuda_record_memory_history`)."""
    torch.cuda.memory._dump_snapshot(path)
