"""Lightning plugins: :class:`CompressedCheckpointIO`, re-exported from its home :mod:`lightning_lowmem.checkpoints`
(imported lazily, it needs Lightning)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_lowmem._lazy import lazy_exports

_EXPORTS = {
    "CompressedCheckpointIO": "lightning_lowmem.checkpoints.compressed_io",
    "CheckpointCorruptError": "lightning_lowmem.checkpoints.file_format",
}
__all__ = ["CheckpointCorruptError", "CompressedCheckpointIO"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from lightning_lowmem.checkpoints.compressed_io import CompressedCheckpointIO
    from lightning_lowmem.checkpoints.file_format import CheckpointCorruptError
