"""Moved to :mod:`lightning_lowmem.checkpoints.sharded` (the one checkpoint home); kept so old imports work."""

from lightning_lowmem.checkpoints.sharded import (
    SHARDED_HINT,
    consolidate_checkpoint,
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    reject_sharded_checkpoint,
)

__all__ = [
    "SHARDED_HINT",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "load_sharded_checkpoint",
    "reject_sharded_checkpoint",
]
