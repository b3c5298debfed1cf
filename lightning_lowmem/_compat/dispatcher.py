"""The dispatcher: dispatch keys an op skips and the kernels a ``torch.library.Library`` registered.

Each function names the private name it uses and why no public API does the job (the estimate's CUDA autocast
rules, :mod:`lightning_lowmem.planning.cuda_autocast`, need both).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["below_cpu_autocast", "drop_library"]


def below_cpu_autocast() -> Any:
    """Ops skip CPU autocast's dispatch key, as autocast's own kernels run their op (planning/cuda_autocast.py).

    Why private: ``torch._C._ExcludeDispatchKeyGuard`` is the Python form of C++'s ``ExcludeDispatchKeyGuard``.
    """
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def drop_library(library: Any) -> None:
    """Remove the kernels a ``torch.library.Library`` registered, now. Why private: ``_destroy`` is what its
    finalizer calls; garbage collection would leave them installed for an unknown time."""
    library._destroy()
