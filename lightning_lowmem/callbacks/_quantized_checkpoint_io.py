"""Let ``Trainer.fit/validate/test(ckpt_path=...)`` read checkpoints that hold torchao tensors.

Lightning's ``TorchCheckpointIO`` loads with ``map_location=lambda storage, loc: storage`` (everything
on CPU); torch cannot rebuild tensor subclasses, such as torchao's quantized weights, through a callable
``map_location``. The quantization callbacks swap in a ``TorchCheckpointIO`` that passes ``"cpu"``
instead (the same placement) for the duration of a stage and put the original back at teardown.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override


class CpuMapCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose default ``map_location`` is ``"cpu"`` rather than a callable."""

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        return super().load_checkpoint(path, map_location=map_location or "cpu", weights_only=weights_only)


def swap_in(trainer: L.Trainer) -> TorchCheckpointIO | None:
    """Replace the strategy's plain ``TorchCheckpointIO`` (only that: a user's own plugin is kept).
    Returns the replaced plugin, for :func:`swap_back`, or ``None``."""
    original = trainer.strategy.checkpoint_io
    if type(original) is not TorchCheckpointIO:
        return None
    trainer.strategy.checkpoint_io = CpuMapCheckpointIO()
    return original


def swap_back(trainer: L.Trainer, original: TorchCheckpointIO | None) -> None:
    if original is not None and isinstance(trainer.strategy.checkpoint_io, CpuMapCheckpointIO):
        trainer.strategy.checkpoint_io = original
