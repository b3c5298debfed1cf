"""Output-head losses that never hold a language model's whole ``(tokens, vocabulary)`` logits:
:func:`linear_cross_entropy` (``linear``) and the switch that routes a model's loss through it (``models``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_lowmem._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ChunkedLoss": "lightning_lowmem.functional.cross_entropy.models",
    "DeferredLogits": "lightning_lowmem.functional.cross_entropy.models",
    "LogitsNotComputedError": "lightning_lowmem.functional.cross_entropy.models",
    "chunk_cross_entropy_": "lightning_lowmem.functional.cross_entropy.models",
    "chunked_cross_entropy": "lightning_lowmem.functional.cross_entropy.models",
    "default_chunk_size": "lightning_lowmem.functional.cross_entropy.linear",
    "linear_cross_entropy": "lightning_lowmem.functional.cross_entropy.linear",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what the lazy exports resolve to, for IDEs and type checkers
    from lightning_lowmem.functional.cross_entropy.linear import default_chunk_size, linear_cross_entropy
    from lightning_lowmem.functional.cross_entropy.models import (
        ChunkedLoss,
        DeferredLogits,
        LogitsNotComputedError,
        chunk_cross_entropy_,
        chunked_cross_entropy,
    )
