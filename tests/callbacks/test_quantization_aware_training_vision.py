"""QuantizationAwareTraining on a conv net (#25): it says at setup, before any training step, how little of
the model it covers (torchao 0.18 has no fake-quantized convolution), not only after training."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_lowmem.callbacks.quantization_aware_training import (
    QuantizationAwareTraining,
)
from lightning_lowmem.functional.quantization.qat import qat_coverage_warning
from lightning_lowmem.warnings import LowMemWarning
from tests.vision_zoo import hf_vit, image_batch, staged_cnn


class CNNModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = staged_cnn()

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.model(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RecordAtFirstBatch(L.Callback):
    def __init__(self, caught: list) -> None:
        self.caught, self.seen_before_training = caught, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.seen_before_training is None:
            self.seen_before_training = [str(w.message) for w in self.caught if issubclass(w.category, LowMemWarning)]


def test_qat_on_a_cnn_warns_at_setup_with_its_coverage(tiny_trainer_kwargs):
    data = DataLoader(TensorDataset(*image_batch(8)), batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorder = RecordAtFirstBatch(caught)
        qat = QuantizationAwareTraining("int8_weight_only", convert_on_fit_end=False)
        L.Trainer(callbacks=[qat, recorder], max_steps=1, **tiny_trainer_kwargs).fit(CNNModule(), data)
    messages = [m for m in recorder.seen_before_training if "QuantizationAwareTraining: QAT" in m]
    assert len(messages) == 1
    assert "fake-quantizes 1 layers holding 1% of CNNModule's parameter bytes" in messages[0]
    assert "the 9 nn.Conv2d layers train in float" in messages[0] and "Conv2d 73.69 KiB" in messages[0]
    assert qat.prepared == ["model.fc"]


def test_no_coverage_warning_on_a_vision_transformer():
    model = hf_vit()  # nn.Linear projections (HF attention): QAT reaches them
    from lightning_lowmem.functional.quantization.qat import qat_layers

    names = qat_layers(model, "int8_weight_only")
    assert qat_coverage_warning(model, names, "int8_weight_only") is None


@pytest.mark.parametrize("mode", ["int8_weight_only", "intx4_weight_only"])
def test_coverage_of_a_conv_only_model_is_zero(mode):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3))
    assert qat_coverage_warning(model, [], mode).startswith(f"QAT (mode={mode!r}) fake-quantizes 0 layers holding 0%")
