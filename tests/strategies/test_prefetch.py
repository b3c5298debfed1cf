"""Prefetching loader and the DataLoader queue estimate."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_lowmem.strategies.low_memory import LowMemoryStrategy
from lightning_lowmem.strategies.prefetch import CUDAPrefetchLoader, batch_bytes, prefetched_bytes


def _loader(**kwargs) -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(torch.arange(40, dtype=torch.float32).reshape(10, 4), torch.arange(10))
    return torch.utils.data.DataLoader(data, batch_size=4, **kwargs)


def test_batch_bytes_and_queue_estimate():
    batch = next(iter(_loader()))
    assert batch_bytes(batch) == 4 * 4 * 4 + 4 * 8  # float32 (4, 4) + int64 (4,)
    assert batch_bytes({"x": batch[0], "meta": "text"}) == 64
    assert prefetched_bytes(_loader(), 100) == 0  # no workers: nothing queued
    assert prefetched_bytes(_loader(num_workers=3), 100) == 2 * 3 * 100  # torch's default prefetch_factor 2
    assert prefetched_bytes(_loader(num_workers=2, prefetch_factor=5), 100) == 5 * 2 * 100


def test_prefetch_loader_needs_a_cuda_device():
    with pytest.raises(ValueError, match=r"`device`='cpu': CUDAPrefetchLoader copies to a CUDA device only"):
        CUDAPrefetchLoader(_loader(), "cpu")


@pytest.mark.cuda
def test_prefetch_loader_yields_the_same_batches_on_the_gpu():
    loader = _loader(pin_memory=True)
    prefetching = CUDAPrefetchLoader(loader, torch.device("cuda", 0))
    assert len(prefetching) == 3 and prefetching.batch_size == 4  # DataLoader attributes pass through
    batches = list(prefetching)
    torch.cuda.synchronize()
    assert len(batches) == 3 and all(x.is_cuda and y.is_cuda for x, y in batches)
    for (x, y), (x_ref, y_ref) in zip(batches, loader, strict=True):
        assert torch.equal(x.cpu(), x_ref) and torch.equal(y.cpu(), y_ref)


@pytest.mark.cuda
def test_prefetch_strategy_trains_on_the_gpu(tmp_path):
    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            assert x.is_cuda
            return self.layer(x).float().sub(y.float().unsqueeze(1)).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=LowMemoryStrategy(prefetch=True),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Model(), _loader(pin_memory=True))
    assert isinstance(trainer.train_dataloader, CUDAPrefetchLoader)
    assert trainer.global_step == 3
