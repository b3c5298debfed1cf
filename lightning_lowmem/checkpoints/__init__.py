"""Checkpoints, in one place: what wrote a file and its check (``records``), the compressed file
(``file_format``) and its ``CheckpointIO`` (``compressed_io``), the one reader of every file (``reading``),
quantized weights (``quantized``), sharded FSDP folders (``sharded``) and the rules for resuming optimizer
state (``optimizer_state``). The one sparse format is
:mod:`lightning_lowmem.functional.pruning.sparse_format` (a pure tensor transform, used here).

The records API is imported here directly (it needs neither Lightning nor torch); the rest loads on first use,
so ``import lightning_lowmem.checkpoints`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_lowmem._lazy import lazy_exports
from lightning_lowmem.checkpoints.records import (
    KEY,
    CheckpointMismatchError,
    check,
    check_trainer,
    guard_module_loading,
    record,
    records,
    trainer_readers,
    unguard_module_loading,
)

_LAZY: dict[str, str] = {
    "CompressedCheckpointIO": "lightning_lowmem.checkpoints.compressed_io",
    "CheckpointCorruptError": "lightning_lowmem.checkpoints.file_format",
    "consolidate_checkpoint": "lightning_lowmem.checkpoints.sharded",
    "read_checkpoint": "lightning_lowmem.checkpoints.reading",
    "load_quantized_checkpoint": "lightning_lowmem.checkpoints.quantized",
    "quantize_like_checkpoint": "lightning_lowmem.checkpoints.quantized",
}

__all__ = [
    "KEY",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CompressedCheckpointIO",
    "check",
    "check_trainer",
    "consolidate_checkpoint",
    "guard_module_loading",
    "load_quantized_checkpoint",
    "quantize_like_checkpoint",
    "read_checkpoint",
    "record",
    "records",
    "trainer_readers",
    "unguard_module_loading",
]
__getattr__, _dir = lazy_exports(__name__, _LAZY)


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from lightning_lowmem.checkpoints.compressed_io import CompressedCheckpointIO
    from lightning_lowmem.checkpoints.file_format import CheckpointCorruptError
    from lightning_lowmem.checkpoints.quantized import (
        load_quantized_checkpoint,
        quantize_like_checkpoint,
    )
    from lightning_lowmem.checkpoints.reading import read_checkpoint
    from lightning_lowmem.checkpoints.sharded import consolidate_checkpoint
