"""Re-export of :mod:`lightning_lowmem.checkpoints.compressed_io`, the home of ``CompressedCheckpointIO``.

Kept because it is a documented import path and because compressed files name it in their first bytes
(``written_by_CompressedCheckpointIO``, what a plain ``torch.load`` of such a file runs into).
"""

from lightning_lowmem.checkpoints.compressed_io import (
    CODECS,
    CheckpointCorruptError,
    CompressedCheckpointIO,
    checkpoint_sizes,
    written_by_CompressedCheckpointIO,
)
from lightning_lowmem.checkpoints.file_format import MAGIC, PREFIX

__all__ = [
    "CODECS",
    "MAGIC",
    "PREFIX",
    "CheckpointCorruptError",
    "CompressedCheckpointIO",
    "checkpoint_sizes",
    "written_by_CompressedCheckpointIO",
]
