"""Thin Lightning callbacks: they decide *when* a technique runs; ``functional/`` holds *what* it does.

Names are imported lazily so a callback's optional dependency loads only when that callback is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MemoryMonitor": "memory_monitor",
    "ScheduledPruning": "scheduled_pruning",
    "PostTrainingQuantization": "post_training_quantization",
    "QuantizationAwareTraining": "quantization_aware_training",
    "ActivationCheckpointing": "activation_checkpointing",
    "ActivationCompression": "activation_compression",
    "MemoryEfficientOptimizer": "memory_efficient_optimizer",
    "AutoMicrobatch": "auto_microbatch",
    "LowRankAdapters": "low_rank_adapters",
    "ChunkedCrossEntropy": "chunked_cross_entropy",
    "FreezeLayers": "freeze_layers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_lowmem.callbacks' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lightning_lowmem.callbacks.{_EXPORTS[name]}"), name)
