"""Callback order never changes what is measured: MemoryMonitor tracks the step exactly as it runs."""

from __future__ import annotations

import itertools

import lightning as L
import pytest
import torch

from lightning_lowmem import ActivationCheckpointing, ActivationCompression, MemoryEfficientOptimizer, MemoryMonitor
from lightning_lowmem.demo import CharLM, CharLMDataModule

MAKERS = {
    "monitor": lambda: MemoryMonitor(summary=False),
    "compression": lambda: ActivationCompression("int8", min_bytes=0),
    "checkpointing": lambda: ActivationCheckpointing("Block"),
    "optimizer": lambda: MemoryEfficientOptimizer("adafactor"),
}


def _measured_step(order: tuple[str, ...], trainer_kwargs: dict, data: CharLMDataModule) -> tuple[int, tuple]:
    torch.manual_seed(0)
    callbacks = [MAKERS[name]() for name in order]
    trainer = L.Trainer(max_steps=2, limit_val_batches=0, callbacks=callbacks, **trainer_kwargs)
    trainer.fit(CharLM(n_layer=2, n_embd=32, n_head=2, block_size=16), data)
    report = callbacks[order.index("monitor")].last_report
    return report.peak_bytes, tuple(sorted(report.breakdown.items()))


def test_every_order_of_monitor_compression_checkpointing_optimizer_measures_the_same_step(tiny_trainer_kwargs):
    data = CharLMDataModule(block_size=16, batch_size=8, max_chars=20_000)
    results = {order: _measured_step(order, tiny_trainer_kwargs, data) for order in itertools.permutations(MAKERS)}
    # same peak and same breakdown, byte for byte (the monitor first in the list was always right)
    assert len(set(results.values())) == 1, {" > ".join(order): peak for order, (peak, _) in results.items()}


@pytest.mark.parametrize("order", [("compression", "monitor"), ("monitor", "compression")])
def test_compression_before_the_monitor_is_measured_compressed(order, tiny_trainer_kwargs):
    """The README's order ([ActivationCompression, MemoryMonitor]) once measured an uncompressed step."""
    data = CharLMDataModule(block_size=16, batch_size=8, max_chars=20_000)
    compressed, _ = _measured_step(order, tiny_trainer_kwargs, data)
    plain, _ = _measured_step(("monitor",), tiny_trainer_kwargs, data)
    assert compressed < 0.97 * plain
