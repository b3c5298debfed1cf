"""Thin Lightning callbacks: they decide *when* a technique runs; ``functional/`` holds *what* it does.

One callback per module, found by file: ``snake_name.py`` defines and exports ``SnakeName`` (``memory_monitor.py`` ->
``MemoryMonitor``), so a new callback is its file and nothing else here. Names are imported lazily so a callback's
optional dependency loads only when that callback is used.
"""

from __future__ import annotations

from pathlib import Path

from lightning_lowmem._lazy import class_exports, lazy_exports

_EXPORTS = class_exports(__name__, Path(__file__).parent)
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
