"""`digits`: scikit-learn's shipped 8x8 handwritten digits (1,797 images, 10 classes), no download."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NUM_CLASSES = 10


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """Images as float (N, 1, 8, 8) scaled to [0, 1] and labels as long (N,)."""
    from lightning_lowmem._versions import optional_import

    datasets = optional_import(
        "sklearn.datasets", "the `digits` workload", extra="examples", distribution="scikit-learn"
    )
    bunch = datasets.load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    return images, labels


class DigitsDataModule(L.LightningDataModule):
    """Digits split deterministically (by ``seed``) into train / val / test.

    Args:
        batch_size: images per batch. Default: 64.
        val_fraction: share held out for validation. Default: 0.15.
        test_fraction: share held out for testing. Default: 0.15.
        seed: permutation seed of the split. Default: 0.
        num_workers: DataLoader workers. Default: 0.

    Example::

        >>> dm = DigitsDataModule(batch_size=32)
        >>> dm.setup("fit")
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> tuple(x.shape), y.dtype
        ((32, 1, 8, 8), torch.int64)
    """

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"`batch_size` must be > 0, got {batch_size}")
        if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(
                f"`val_fraction`={val_fraction} and `test_fraction`={test_fraction} must be in (0, 1) with a sum < 1"
            )
        self.save_hyperparameters()
        self._splits: dict[str, TensorDataset] = {}

    def setup(self, stage: str | None = None) -> None:
        if self._splits:
            return
        images, labels = load_digits_tensors()
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.hparams.seed))
        n_val = int(len(labels) * self.hparams.val_fraction)
        n_test = int(len(labels) * self.hparams.test_fraction)
        parts = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
        self._splits = {name: TensorDataset(images[idx], labels[idx]) for name, idx in parts.items()}

    @property
    def train_set(self) -> TensorDataset:
        self.setup()
        return self._splits["train"]

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        self.setup()
        return DataLoader(
            self._splits[split],
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            num_workers=self.hparams.num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")


def digits_mlp(hidden: int = 256, depth: int = 2) -> nn.Sequential:
    """An MLP on flattened 8x8 images: ``depth`` hidden layers of width ``hidden``."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = 64
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, NUM_CLASSES))
    return nn.Sequential(*layers)


def digits_cnn(width: int = 32) -> nn.Sequential:
    """A small conv net: two 3x3 conv blocks of ``width`` and ``2*width`` channels, then a classifier."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),  # (B, 2w, 4, 4)
        nn.Conv2d(2 * width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, NUM_CLASSES),
    )


class DigitsClassifier(L.LightningModule):
    """Classifies digits; logs ``train_loss``, ``val_loss``, ``val_acc``, ``test_acc`` (torchmetrics).

    Args:
        arch: ``"mlp"`` or ``"cnn"``. Default: ``"mlp"``.
        hidden: MLP width (``mlp``) or first conv width (``cnn``). Default: 256.
        depth: MLP hidden layers (ignored for ``cnn``). Default: 2.
        lr: learning rate. Default: 3e-3.
        weight_decay: weight decay. Default: 1e-4.
        optimizer: optimizer name for :func:`~lightning_lowmem.functional.optimizers.build_optimizer`.
            Default: ``"adamw"``.

    Example::

        >>> DigitsClassifier(arch="cnn", hidden=8)(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        arch: str = "mlp",
        hidden: int = 256,
        depth: int = 2,
        lr: float = 3e-3,
        weight_decay: float = 1e-4,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        if arch not in ("mlp", "cnn"):
            raise ValueError(f"`arch`={arch!r} is unknown; choose 'mlp' or 'cnn'")
        if hidden <= 0 or depth <= 0:
            raise ValueError(f"`hidden` and `depth` must be > 0, got {hidden}, {depth}")
        self.save_hyperparameters()
        self.model = digits_mlp(hidden, depth) if arch == "mlp" else digits_cnn(hidden)
        from torchmetrics.classification import MulticlassAccuracy

        self.val_acc = MulticlassAccuracy(num_classes=NUM_CLASSES)
        self.test_acc = MulticlassAccuracy(num_classes=NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_acc(logits, y)
        self.log("test_loss", F.cross_entropy(logits, y))
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        from lightning_lowmem.functional.optimizers.catalog import build_optimizer

        return build_optimizer(
            self.hparams.optimizer, self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
