"""Lightning plugins: :class:`CompressedCheckpointIO` (imported lazily, it needs Lightning)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CompressedCheckpointIO": "compressed_checkpoint_io",
    "CheckpointCorruptError": "compressed_checkpoint_io",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_lowmem.plugins' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lightning_lowmem.plugins.{_EXPORTS[name]}"), name)
