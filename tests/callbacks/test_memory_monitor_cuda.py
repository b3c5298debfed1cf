"""MemoryMonitor on CUDA: the allocator's figures every step, and an allocator snapshot written when a
real CUDA out-of-memory error ends the run. GPU only (``cuda`` marker)."""

from __future__ import annotations

import pickle

import lightning as L
import pytest
import torch
from torch import nn

from lightning_lowmem.callbacks.memory_monitor import MemoryMonitor

pytestmark = pytest.mark.cuda


class _Model(L.LightningModule):
    def __init__(self, oom_at_step: int | None = None) -> None:
        super().__init__()
        self.layer = nn.Linear(1024, 1024)
        self.oom_at_step = oom_at_step

    def training_step(self, batch, batch_idx):
        if self.oom_at_step is not None and batch_idx == self.oom_at_step:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # more than the GPU has: a real OOM
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 1024)), batch_size=16)


def _trainer(tmp_path, monitor: MemoryMonitor) -> L.Trainer:
    return L.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[monitor],
    )


def test_memory_monitor_logs_the_allocator_figures(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, deep_every_n_steps=2, summary=False)
    _trainer(tmp_path, monitor).fit(_Model(), _loader())
    cheap = [row for row in monitor.history if "allocated" in row]
    assert len(cheap) == 4
    weights = 1024 * 1024 * 4
    assert all(row["allocated"] >= weights and row["reserved"] >= row["allocated"] for row in cheap)
    assert all(row["max_allocated"] >= row["allocated"] for row in cheap)
    deep = [row for row in monitor.history if "peak" in row]
    assert deep and all(row["parameters"] >= weights for row in deep)


def test_memory_monitor_writes_an_allocator_snapshot_on_a_real_oom(tmp_path):
    path = tmp_path / "oom.pickle"
    monitor = MemoryMonitor(snapshot_on_oom=True, snapshot_path=str(path), summary=False)
    with pytest.raises(torch.OutOfMemoryError):
        _trainer(tmp_path, monitor).fit(_Model(oom_at_step=2), _loader())
    snapshot = pickle.loads(path.read_bytes())
    assert snapshot["segments"], "the snapshot holds no allocator segment"
    assert any(trace for trace in snapshot.get("device_traces", [])), "no allocation history was recorded"
