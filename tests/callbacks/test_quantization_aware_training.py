"""QuantizationAwareTraining: prepare/convert around fit and Lightning's three old QAT regressions."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_lowmem.callbacks.quantization_aware_training import QuantizationAwareTraining

warnings.filterwarnings("ignore", module="torchao")


class TinyClassifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        inputs = torch.randn(64, 32)
        self.data = TensorDataset(inputs, inputs[:, :4].argmax(1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=16)

    val_dataloader = test_dataloader = train_dataloader


def is_converted(module: TinyClassifier) -> bool:
    return all(type(module.net[i].weight).__name__ == "IntxUnpackedToInt8Tensor" for i in (0, 2))


def test_prepares_trains_and_converts(tiny_trainer_kwargs):
    callback = QuantizationAwareTraining("intx4_weight_only", start_step=2)
    module = TinyClassifier()
    before = module.net[0].weight.detach().clone()
    L.Trainer(callbacks=[callback], max_steps=4, num_sanity_val_steps=0, **tiny_trainer_kwargs).fit(module)
    assert callback.prepared == ["net.0", "net.2"] and callback.converted == ["net.0", "net.2"]
    assert is_converted(module) and type(module.net[0]) is nn.Linear
    assert not torch.equal(module.net[0].weight.dequantize(), before)  # it trained
    assert callback.report.bytes_after < callback.report.bytes_before / 3


def test_fit_called_twice(tiny_trainer_kwargs):  # Lightning #7427
    callback = QuantizationAwareTraining("intx4_weight_only")
    module = TinyClassifier()
    trainer = L.Trainer(callbacks=[callback], max_steps=2, num_sanity_val_steps=0, **tiny_trainer_kwargs)
    trainer.fit(module)
    first = module.net[0].weight.dequantize().clone()
    trainer = L.Trainer(callbacks=[callback], max_steps=4, num_sanity_val_steps=0, **tiny_trainer_kwargs)
    trainer.fit(module)
    assert trainer.global_step == 4 and is_converted(module)
    assert not torch.equal(module.net[0].weight.dequantize(), first)  # the second fit trained


def test_test_with_ckpt_path_after_qat(tiny_trainer_kwargs, tmp_path):  # Lightning #12896
    callback = QuantizationAwareTraining("intx4_weight_only")
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss")
    kwargs = {**tiny_trainer_kwargs, "enable_checkpointing": True}
    trainer = L.Trainer(callbacks=[callback, checkpoint], max_epochs=2, **kwargs)
    module = TinyClassifier()
    trainer.fit(module)
    results = trainer.test(module, ckpt_path="best", verbose=False)
    assert results[0]["test_loss"] > 0 and is_converted(module)


def test_test_with_ckpt_path_of_converted_model(tiny_trainer_kwargs, tmp_path):
    trainer = L.Trainer(callbacks=[QuantizationAwareTraining("intx4_weight_only")], max_steps=2, **tiny_trainer_kwargs)
    module = TinyClassifier()
    trainer.fit(module)
    path = str(tmp_path / "converted.ckpt")
    trainer.save_checkpoint(path)  # holds torchao tensors (converted at fit end)
    fresh = TinyClassifier()
    tester = L.Trainer(callbacks=[QuantizationAwareTraining("intx4_weight_only")], **tiny_trainer_kwargs)
    results = tester.test(fresh, ckpt_path=path, verbose=False)
    inputs = torch.randn(4, 32)
    assert is_converted(fresh) and torch.equal(fresh(inputs), module(inputs)) and results[0]["test_loss"] > 0


def test_works_with_scheduled_pruning(tiny_trainer_kwargs):  # Lightning #11047
    scheduled_pruning = pytest.importorskip("lightning_lowmem.callbacks.scheduled_pruning")
    from lightning_lowmem.functional.quantization.qat import prepare_qat_

    module = TinyClassifier()
    # ScheduledPruning's automatic target search only looks at leaf modules and FakeQuantizedLinear has a
    # child (its fake quantizer), so prepare first and name the layers explicitly.
    prepare_qat_(module, "int8_weight_only")
    targets = [(module.net[0], "weight"), (module.net[2], "weight")]
    pruning = scheduled_pruning.ScheduledPruning("l1_unstructured", parameters_to_prune=targets, amount=0.5)
    callback = QuantizationAwareTraining("int8_weight_only")
    L.Trainer(callbacks=[callback, pruning], max_epochs=2, num_sanity_val_steps=0, **tiny_trainer_kwargs).fit(module)
    weight = module.net[0].weight
    assert type(weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert float((weight.dequantize() == 0).float().mean()) >= 0.3  # pruned zeros survive quantization


def test_state_dict_round_trip():
    callback = QuantizationAwareTraining()
    callback.prepared = ["net.0"]
    other = QuantizationAwareTraining()
    other.load_state_dict(callback.state_dict())
    assert other.prepared == ["net.0"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="`mode`='int8_dynamic' is not a QAT mode"):
        QuantizationAwareTraining("int8_dynamic")
    with pytest.raises(ValueError, match="`start_step` must be an int >= 0, got -1"):
        QuantizationAwareTraining(start_step=-1)
    with pytest.raises(ValueError, match="`freeze_bn_step` must be None or an int >= 0"):
        QuantizationAwareTraining(freeze_bn_step=-2)


class CrashAt(L.Callback):
    """Raise (like a killed process) when training reaches ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


class OneBatchRepeated(TinyClassifier):
    """Four copies of one batch per epoch: Lightning restarts an interrupted epoch's loader from the top, so
    only identical batches make "the same steps" independent of where the run was cut."""

    def __init__(self) -> None:
        super().__init__()
        inputs, targets = self.data.tensors
        self.data = TensorDataset(inputs[:16].repeat(4, 1), targets[:16].repeat(4))


def test_resume_past_start_step_keeps_fake_quantization_bit_identical(tiny_trainer_kwargs, tmp_path):
    """Issue 20: setup() decided before Lightning restored the step, and re-enabling waited for step == start_step:
    a run resumed past start_step trained in float from the crash on."""

    def trainer(callbacks, **kwargs):
        return L.Trainer(
            callbacks=callbacks,
            max_steps=12,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            **{**tiny_trainer_kwargs, **kwargs},
        )

    def weights(module):
        return {name: p.detach().clone() for name, p in module.net.named_parameters()}

    uninterrupted = OneBatchRepeated()
    trainer([QuantizationAwareTraining("int8_weight_only", start_step=2, convert_on_fit_end=False)]).fit(uninterrupted)

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)  # 4 batches per epoch: step 4, 8
    crashed = OneBatchRepeated()
    with pytest.raises(RuntimeError, match="simulated crash"):
        callbacks = [
            QuantizationAwareTraining("int8_weight_only", start_step=2, convert_on_fit_end=False),
            checkpoint,
            CrashAt(10),
        ]
        trainer(callbacks, enable_checkpointing=True).fit(crashed)
    resumed = OneBatchRepeated()
    callback = QuantizationAwareTraining("int8_weight_only", start_step=2, convert_on_fit_end=False)
    trainer([callback]).fit(resumed, ckpt_path=str(tmp_path / "last.ckpt"))  # resumes at step 8 > start_step
    expected, got = weights(uninterrupted), weights(resumed)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert callback._fake_quant_on is True
