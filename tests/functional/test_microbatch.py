"""AutoMicrobatch, the strategies and the estimator split batches with one function (functional.microbatch)."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

import lightning_lowmem.functional.microbatch as microbatch
from lightning_lowmem.callbacks.auto_microbatch import AutoMicrobatch
from lightning_lowmem.functional.config import TrainingConfig
from lightning_lowmem.planning.estimate import _train_step


def _batch() -> dict:
    """A dict batch with a ragged key: token rows, a 0-dim scalar and per-sample strings of different lengths."""
    generator = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(5, 4, generator=generator),
        "y": torch.randn(5, 1, generator=generator),
        "temperature": torch.tensor(0.5),
        "names": ["a", "bb", "ccc", "dddd", "eeeee"],
    }


def _loss(module: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.mse_loss(module(batch["x"]) * batch["temperature"], batch["y"])


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return _loss(self.layer, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([_batch()], batch_size=None)


def _recorded(monkeypatch) -> list:
    """Every call of the shared slicing function, with the micro-batch it produced."""
    calls: list = []
    original = microbatch.slice_batch

    def spy(batch, start, stop):
        part = original(batch, start, stop)
        calls.append(((start, stop), part))
        return part

    monkeypatch.setattr(microbatch, "slice_batch", spy)
    return calls


def test_auto_microbatch_and_the_estimator_produce_the_same_micro_batches(monkeypatch, tiny_trainer_kwargs):
    calls = _recorded(monkeypatch)
    model = _Net()
    trainer = L.Trainer(callbacks=[AutoMicrobatch(micro_batch_size=2)], **{**tiny_trainer_kwargs, "max_steps": 1})
    trainer.fit(model)
    from_callback, calls[:] = list(calls), []

    layer = nn.Linear(4, 1)
    _train_step(
        layer,
        _batch(),
        lambda m, b: _loss(m, b),
        torch.optim.SGD(layer.parameters(), lr=0.1),
        TrainingConfig(micro_batch_size=2),
        None,
        loop="torch",
    )
    from_estimator = list(calls)

    assert [span for span, _ in from_callback] == [(0, 2), (2, 4), (4, 5)]  # failed before: two splitters
    assert [span for span, _ in from_estimator] == [span for span, _ in from_callback]
    for (_, ours), (_, theirs) in zip(from_callback, from_estimator, strict=True):
        assert torch.equal(ours["x"], theirs["x"]) and torch.equal(ours["y"], theirs["y"])
        assert ours["names"] == theirs["names"] == _batch()["names"] and float(ours["temperature"]) == 0.5
