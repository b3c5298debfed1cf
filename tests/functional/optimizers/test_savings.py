"""What a lean optimizer saves per model family (#25 item 7): the predicted state equals what torch / torchao
allocate, and MemoryEfficientOptimizer warns where the lean optimizer will not save (conv nets), not on a
transformer."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from torch import nn

from lightning_lowmem import MemoryEfficientOptimizer
from lightning_lowmem.functional.optimizers.catalog import build_optimizer
from lightning_lowmem.functional.optimizers.savings import (
    lean_optimizer_warning,
    predicted_state_bytes,
)
from lightning_lowmem.memory.measure import state_bytes
from lightning_lowmem.warnings import LowMemWarning
from tests.vision_zoo import (
    hf_resnet,
    image_batch,
    mha_classifier,
    staged_cnn,
    token_batch,
)


def one_step(model: nn.Module, name: str, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.optim.Optimizer:
    optimizer = build_optimizer(name, model.parameters(), lr=1e-3)
    output = model(batch[0])
    nn.functional.cross_entropy(getattr(output, "logits", output), batch[1]).backward()
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("name", ["adamw8bit", "adafactor"])
@pytest.mark.parametrize(
    ("make", "batch"),
    [(hf_resnet, image_batch), (staged_cnn, image_batch), (lambda: mha_classifier(width=64), token_batch)],
)
def test_predicted_state_is_the_allocated_state(make, batch, name):
    pytest.importorskip("torchao")
    model = make()
    optimizer = one_step(model, name, batch(4))
    assert predicted_state_bytes(name, model.parameters())[0] == state_bytes(model, [optimizer])["optimizer_state"]


def test_per_family_figures():
    # width-16 CNN: every 3x3 conv holds 2304 < 4096 weights, so 8-bit AdamW keeps fp32 moments: no saving
    lean, adamw = predicted_state_bytes("adamw8bit", staged_cnn().parameters())
    assert lean / adamw == pytest.approx(1.0, abs=0.001)
    # torch's Adafactor on 1x1 convolutions: C_out * C_in * (1 + 1) floats, 2x a full second moment
    conv_1x1 = nn.Conv2d(256, 256, 1, bias=False)
    assert predicted_state_bytes("adafactor", conv_1x1.parameters()) == (2 * 4 * 256 * 256 + 4, 8 * 256 * 256)
    # a transformer's matrices: rows + cols floats each
    lean, adamw = predicted_state_bytes("adafactor", mha_classifier(width=64).parameters())
    assert lean / adamw < 0.03


class Classifier(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        return nn.functional.cross_entropy(self.model(inputs), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], name: str, tmp_path) -> list[str]:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*batch), batch_size=4)
    trainer = L.Trainer(
        max_steps=1,
        callbacks=[MemoryEfficientOptimizer(name, lr=1e-3)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Classifier(model), data)
    return [str(w.message) for w in caught if issubclass(w.category, LowMemWarning)]


def test_warns_once_on_a_cnn_where_8bit_adamw_saves_nothing(tmp_path):
    pytest.importorskip("torchao")
    messages = [m for m in fit(staged_cnn(), image_batch(4), "adamw8bit", tmp_path) if "optimizer state" in m]
    assert len(messages) == 1
    assert "adamw8bit keeps 151.07 KiB of optimizer state here, 1.00x fp32 AdamW's 150.95 KiB" in messages[0]
    assert "29 of 29 parameter tensors (100% of the parameters) have fewer than 4096 elements" in messages[0]


def test_adafactor_on_1x1_convs_warns_with_the_reason():
    model = nn.Sequential(nn.Conv2d(64, 256, 1), nn.ReLU(), nn.Conv2d(256, 64, 1))
    message = lean_optimizer_warning("adafactor_in_backward", model.parameters())
    assert message.startswith("adafactor_in_backward keeps 257.27 KiB of optimizer state here, 1.00x fp32 AdamW")
    assert "2 are 1 x 1: 2x a full second moment" in message


@pytest.mark.parametrize("name", ["adamw8bit", "adafactor"])
def test_no_warning_on_a_transformer(tmp_path, name):
    pytest.importorskip("torchao")
    assert not [m for m in fit(mha_classifier(width=64), token_batch(4), name, tmp_path) if "optimizer state" in m]
