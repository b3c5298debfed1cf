"""Strategies: ``LowMemoryStrategy`` (``"lowmem"``) and ``LowMemoryDDPStrategy`` (``"lowmem_ddp"``,
``"lowmem_ddp_spawn"``) and ``LowMemoryFSDPStrategy`` (``"lowmem_fsdp"``).

``import lightning_lowmem`` registers the names in Lightning's ``StrategyRegistry`` as soon as
Lightning is imported (see ``_registration.py``); importing ``strategies.low_memory`` registers them too.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PRECISION_PRESETS": "low_memory",
    "LowMemoryStrategy": "low_memory",
    "LowMemoryDDPStrategy": "low_memory",
    "LowMemoryFSDPStrategy": "fsdp",
    "register_lowmem_strategies": "low_memory",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_lowmem.strategies' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lightning_lowmem.strategies.{_EXPORTS[name]}"), name)
