"""`ActivationCompression`: keep the tensors saved for backward as bf16 / int8, or offloaded to host memory."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lowmem.callbacks._technique_base import TechniqueCallback
from lightning_lowmem.functional.compression import CompressionStats, compress_activations
from lightning_lowmem.functional.config import CompressionConfig
from lightning_lowmem.functional.config.constants import COMPRESSION_MIN_BYTES
from lightning_lowmem.warnings import NoEffectWarning

PREFIX = "lowmem/compression"


class ActivationCompression(TechniqueCallback):
    """Run every training step's forward under
    :func:`lightning_lowmem.functional.compression.compress_activations`.

    The tensors autograd saves for backward are stored compressed and restored when backward needs
    them: ``"int8"`` cuts their bytes about 3.9x, ``"bf16"`` 2x (for fp32 activations), ``"cpu"``
    moves them to pinned host memory on a side stream (CUDA only; a no-op on a CPU device). Parameters,
    non-float tensors and tensors under ``min_bytes`` stay exact; wrap code that must stay exact in
    :func:`~lightning_lowmem.functional.compression.exact_activations`. Gradients become approximate
    (int8: ~1% relative error on ``charlm``); training loss follows the baseline closely.

    Hugging Face models get ``config.use_cache = False`` while fitting (restored in ``teardown``): a
    training-time KV cache would keep the uncompressed keys and values alive.

    Logs ``lowmem/compression/ratio`` (bytes before / after packing) and
    ``lowmem/compression/packed_mib`` per step.

    Args:
        mode: ``"bf16"``, ``"int8"`` or ``"cpu"``. Default: ``"int8"``.
        min_bytes: tensors smaller than this are not packed. Default: ``COMPRESSION_MIN_BYTES`` (64 KiB).
        log_stats: log the figures above through ``pl_module.log``. Default: ``True``.

    Raises:
        ValueError: ``mode`` is unknown or ``min_bytes`` < 0.
        TypeError: ``min_bytes`` is not an int.

    Warns:
        NoEffectWarning: ``mode="cpu"`` on a CPU device (activations already live in host memory).

    Example::

        >>> from lightning_lowmem.demo import CharLM, CharLMDataModule
        >>> callback = ActivationCompression(mode="int8", min_bytes=0)
        >>> trainer = L.Trainer(max_steps=2, callbacks=[callback], logger=False, enable_progress_bar=False,
        ...                     enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
        >>> trainer.fit(CharLM(n_layer=1, n_embd=32, n_head=2, block_size=16),
        ...             CharLMDataModule(block_size=16, batch_size=4, max_chars=20_000))
        >>> callback.stats.ratio > 3
        True
    """

    technique = "compression"
    changes_step = True  # every training step runs in its saved-tensor hooks
    tags = frozenset({"compression"})
    undo_on_exception = True

    def __init__(self, mode: str = "int8", min_bytes: int = COMPRESSION_MIN_BYTES, log_stats: bool = True) -> None:
        self.config = CompressionConfig(mode, min_bytes)  # validates
        self.mode = mode
        self.min_bytes = min_bytes
        self.log_stats = log_stats
        self.stats = CompressionStats()  # cumulative over the run (resumable)
        self._step_stats: CompressionStats | None = None
        self._region: contextlib.ExitStack | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.mode, min_bytes=self.min_bytes)

    @override
    def composition_label(self) -> str:
        return f"ActivationCompression({self.mode!r})"

    @override
    def setup_technique(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.mode == "cpu" and stage == "fit" and trainer.strategy.root_device.type == "cpu":
            warnings.warn(
                "ActivationCompression(mode='cpu') on a CPU device: activations already live in host memory, "
                "so nothing is offloaded. Use mode='int8' or 'bf16' to save memory on CPU.",
                NoEffectWarning,
                stacklevel=2,
            )
        if stage == "fit" and self._applied is None:
            rank_zero_info(
                f"ActivationCompression: saved activations packed as {self.mode} (>= {self.min_bytes} bytes)"
            )
            # a Hugging Face model's training-time KV cache keeps the uncompressed keys / values alive: apply holds it
            self.apply_config(pl_module)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.sanity_checking:
            return
        self._close()
        self._step_stats = CompressionStats()
        self._region = contextlib.ExitStack()
        self._region.enter_context(compress_activations(self.config, stats=self._step_stats))

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._close()
        step = self._step_stats
        if step is None:
            return
        for name in ("packed", "kept", "bytes_in", "bytes_out"):
            setattr(self.stats, name, getattr(self.stats, name) + getattr(step, name))
        if self.log_stats and step.bytes_in:
            pl_module.log(f"{PREFIX}/ratio", min(step.ratio, 1e6), on_step=True, on_epoch=False)
            pl_module.log(f"{PREFIX}/packed_mib", step.bytes_in / 2**20, on_step=True, on_epoch=False)
        self._step_stats = None

    @override
    def release(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close()  # then teardown undoes the applied config: the KV cache back as it was

    def _close(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "min_bytes": self.min_bytes, "stats": self.stats.to_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stats = CompressionStats(**state_dict.get("stats", {}))
