"""LowMemoryStrategy(memory_budget=) on a CNN with no repeated block: the checkpointing candidates cannot be built,
so they are skipped and listed -- the strategy trains in the mix that fits instead of refusing to start."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from lightning_lowmem import LowMemoryStrategy, MemoryMonitor
from lightning_lowmem.planning.estimate import TrainingConfig, estimate_memory
from tests.vision_zoo import image_batch, sequential_cnn


class CNNClassifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = sequential_cnn()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return nn.functional.cross_entropy(self(images), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_budget_only_bf16_true_fits_trains_in_bf16_true(tiny_trainer_kwargs):
    batch = image_batch(8)

    def peak(precision: str) -> int:
        config = TrainingConfig(precision=precision, optimizer="adamw")
        return estimate_memory(CNNClassifier(), batch, device="cpu", config=config).peak_bytes

    budget = int((peak("bf16-true") + peak("bf16-mixed")) / 2 / 0.9)  # usable after the 10% margin: in between
    strategy = LowMemoryStrategy(memory_budget=budget)
    monitor = MemoryMonitor(summary=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*image_batch(16)), batch_size=8)
    trainer = L.Trainer(strategy=strategy, max_steps=2, callbacks=[monitor], limit_val_batches=0, **tiny_trainer_kwargs)
    trainer.fit(CNNClassifier(), data)  # used to raise "... not even in micro-batches of 1 sample"
    plan = strategy.plan
    assert plan.config.precision_preset == "bf16-true" and plan.config.micro_batch_size is None
    assert any("'auto' matched no submodule" in reason for reason in plan.skipped)
    assert monitor.last_report.peak_bytes <= budget
    assert monitor.last_report.peak_bytes == plan.predicted_peak_bytes
