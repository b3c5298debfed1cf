"""PostTrainingQuantization on a conv net (#25): the size ratio it reports is the CNN's real one (Conv2d weights
int8), and ``monitor`` without ``tolerance`` reports the metric's change instead of being ignored."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_lowmem.callbacks.post_training_quantization import (
    PostTrainingQuantization,
    load_quantized_checkpoint,
)
from lightning_lowmem.memory.measure import state_bytes
from tests.vision_zoo import image_batch, staged_cnn


class CNNModule(L.LightningModule):
    """``staged_cnn``; ``val_err`` = MSE to the float model's own logits (0 before quantizing)."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = staged_cnn().eval()
        images, _ = image_batch(16)
        with torch.no_grad():
            self.data = TensorDataset(images, self.model(images))

    def forward(self, images):
        return self.model(images)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1]) * 0.0  # weights (and the reference) stay fixed

    def validation_step(self, batch, batch_idx):
        self.log("val_err", F.mse_loss(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=8)


def test_cnn_ships_3_5x_smaller_and_monitor_without_tolerance_reports_the_change(tiny_trainer_kwargs, tmp_path):
    module = CNNModule()
    module.model.eval()  # BatchNorm on running statistics while validating
    float_bytes = state_bytes(module)["parameters"]
    callback = PostTrainingQuantization("int8_weight_only", monitor="val_err", monitor_mode="min", latency_batches=0)
    trainer = L.Trainer(callbacks=[callback], max_steps=1, num_sanity_val_steps=0, **tiny_trainer_kwargs)
    trainer.fit(module)
    convs = [name for name, layer in module.named_modules() if isinstance(layer, torch.nn.Conv2d)]
    assert set(convs) <= set(callback.quantized) and len(convs) == 9
    summary = callback.summary
    assert summary["before"]["bytes"] == float_bytes
    assert summary["before"]["bytes"] / summary["after"]["bytes"] >= 3.5  # was 1.00x: Conv2d stayed float
    assert summary["before"]["metric"] < 1e-10  # the float model's own outputs
    assert 0 < summary["after"]["metric"] < 1e-3  # measured, not ignored (was: no metric at all)
    path = tmp_path / "quantized.ckpt"
    trainer.save_checkpoint(path)
    loaded = load_quantized_checkpoint(CNNModule, path)
    images = module.data.tensors[0]
    assert type(loaded.model.stem[0].weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert torch.equal(loaded.eval()(images), module.eval()(images))
