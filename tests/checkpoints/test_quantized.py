"""Quantized checkpoints through the one checkpoint home: `load_quantized_checkpoint` and PTQ / QAT resume read
files of `CompressedCheckpointIO` and of Lightning's `TorchCheckpointIO` alike, with no CheckpointIO swapped in."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_lowmem.checkpoints import CompressedCheckpointIO, load_quantized_checkpoint, read_checkpoint
from lightning_lowmem.checkpoints.file_format import PREFIX
from lightning_lowmem.functional.quantization.serialization import is_quantized_tensor

pytest.importorskip("torchao")
warnings.filterwarnings("ignore", module="torchao")

PLUGINS = {"torch-io": list, "compressed-io": lambda: [CompressedCheckpointIO()]}


class Net(L.LightningModule):
    """Linear 32 -> 32 -> 4 with a mostly-zero float buffer (packed sparse by CompressedCheckpointIO, so its
    files are always framed); one repeated batch per step, so resumed runs see the very same data."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.register_buffer("sparse", torch.zeros(64, 64))
        self.sparse[0, :5] = torch.arange(1.0, 6.0)
        inputs = torch.randn(16, 32)
        self.data = TensorDataset(inputs.repeat(4, 1), inputs[:, :4].argmax(1).repeat(4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=16)

    val_dataloader = train_dataloader


def _trainer(kwargs, callbacks, plugins, **more):
    return L.Trainer(callbacks=callbacks, plugins=plugins, num_sanity_val_steps=0, **{**kwargs, **more})


def _quantized_checkpoint(kwargs, path, plugins):
    from lightning_lowmem.callbacks import PostTrainingQuantization

    module = Net()
    trainer = _trainer(kwargs, [PostTrainingQuantization("int8_weight_only", latency_batches=0)], plugins, max_steps=1)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    return module


def test_load_quantized_checkpoint_reads_a_compressed_file(tiny_trainer_kwargs, tmp_path):
    path = tmp_path / "q.ckpt"
    module = _quantized_checkpoint(tiny_trainer_kwargs, path, [CompressedCheckpointIO()])
    assert path.read_bytes().startswith(PREFIX)  # framed: a plain torch.load cannot read it
    # failed before: torch.load raised "Unsupported global: GLOBAL ...written_by_CompressedCheckpointIO"
    for map_location in ("cpu", lambda storage, loc: storage, {"cpu": "cpu"}):
        loaded = load_quantized_checkpoint(Net, path, map_location=map_location)
        assert type(loaded.net[0].weight).__name__ == "Int8Tensor" and loaded.net[0].weight.device.type == "cpu"
        inputs = torch.randn(4, 32)
        assert torch.equal(loaded(inputs), module(inputs))
        assert torch.equal(loaded.sparse, module.sparse)  # the packed sparse buffer, rebuilt


def test_load_quantized_checkpoint_reads_a_torchao_pickled_file_under_a_callable_map_location(
    tiny_trainer_kwargs, tmp_path
):
    """Files written before the portable format: torchao tensors pickled the torchao way."""
    module = _quantized_checkpoint(tiny_trainer_kwargs, tmp_path / "q.ckpt", [])
    legacy = tmp_path / "legacy.ckpt"
    torch.save(torch.load(tmp_path / "q.ckpt", weights_only=False), legacy)  # rebuilt tensors pickle torchao's way
    with pytest.raises(RuntimeError, match="Callable map_location not supported"):  # what Lightning's own IO meets
        torch.load(legacy, map_location=lambda storage, loc: storage, weights_only=False)
    loaded = load_quantized_checkpoint(Net, legacy, map_location=lambda storage, loc: storage, weights_only=False)
    inputs = torch.randn(4, 32)
    assert type(loaded.net[2].weight).__name__ == "Int8Tensor" and torch.equal(loaded(inputs), module(inputs))
    resumed = Net()  # and through a Trainer: CompressedCheckpointIO reads it itself, no CheckpointIO swapped in
    from lightning_lowmem.callbacks import PostTrainingQuantization

    checker = _trainer(tiny_trainer_kwargs, [PostTrainingQuantization("int8_weight_only")], [CompressedCheckpointIO()])
    checker.validate(resumed, ckpt_path=str(legacy), verbose=False)
    assert torch.equal(resumed(inputs), module(inputs))


@pytest.mark.parametrize("plugins", PLUGINS)
def test_ptq_checkpoint_back_through_ckpt_path(plugins, tiny_trainer_kwargs, tmp_path):
    from lightning_lowmem.callbacks import PostTrainingQuantization

    path = tmp_path / "q.ckpt"
    module = _quantized_checkpoint(tiny_trainer_kwargs, path, PLUGINS[plugins]())
    assert path.read_bytes().startswith(PREFIX) is (plugins == "compressed-io")
    fresh = Net()
    callback = PostTrainingQuantization("int8_weight_only")
    checker = _trainer(tiny_trainer_kwargs, [callback], PLUGINS[plugins]())
    io_before = checker.strategy.checkpoint_io
    results = checker.validate(fresh, ckpt_path=str(path), verbose=False)
    inputs = torch.randn(4, 32)
    assert callback.quantized == ["net.0", "net.2"] and type(fresh.net[0].weight).__name__ == "Int8Tensor"
    assert torch.equal(fresh(inputs), module(inputs)) and results[0]["val_loss"] > 0
    assert checker.strategy.checkpoint_io is io_before  # nothing swapped in


def _weights(module):
    return {name: p.detach().clone() for name, p in module.net.named_parameters()}


@pytest.mark.parametrize("plugins", PLUGINS)
def test_qat_resume_is_bit_identical_and_converted_checkpoint_tests(plugins, tiny_trainer_kwargs, tmp_path):
    from lightning_lowmem.callbacks import QuantizationAwareTraining

    def qat():
        return QuantizationAwareTraining("int8_weight_only", start_step=2)

    kwargs = {**tiny_trainer_kwargs, "limit_val_batches": 0}
    uninterrupted = Net()
    _trainer(kwargs, [qat()], PLUGINS[plugins](), max_steps=8).fit(uninterrupted)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)  # 4 steps per epoch
    first = Net()
    _trainer(kwargs, [qat(), checkpoint], PLUGINS[plugins](), max_steps=4, enable_checkpointing=True).fit(first)
    last = tmp_path / "last.ckpt"
    assert last.read_bytes().startswith(PREFIX) is (plugins == "compressed-io")
    resumed = Net()
    _trainer(kwargs, [qat()], PLUGINS[plugins](), max_steps=8).fit(resumed, ckpt_path=str(last))
    expected, got = _weights(uninterrupted), _weights(resumed)
    assert all(torch.equal(expected[name].dequantize(), got[name].dequantize()) for name in expected)
    assert is_quantized_tensor(resumed.net[0].weight)  # converted at fit end
    # the converted model's checkpoint back into a fresh model
    trainer = _trainer(kwargs, [qat()], PLUGINS[plugins](), max_steps=8)
    trainer.fit(Net())
    trainer.save_checkpoint(tmp_path / "converted.ckpt")
    fresh = Net()
    _trainer(tiny_trainer_kwargs, [qat()], PLUGINS[plugins]()).validate(
        fresh, ckpt_path=str(tmp_path / "converted.ckpt"), verbose=False
    )
    inputs = torch.randn(4, 32)
    assert is_quantized_tensor(fresh.net[2].weight) and torch.equal(fresh(inputs), resumed(inputs))


def test_read_checkpoint_refuses_an_unknown_map_location(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    with pytest.raises(
        TypeError, match=r"`map_location`=3 is not supported: pass None, a device, a string, a dict or a"
    ):
        read_checkpoint(tmp_path / "a.ckpt", map_location=3)


@pytest.mark.parametrize("plugins", PLUGINS)
def test_weights_only_checkpoint_of_a_quantized_model_back_through_ckpt_path(plugins, tiny_trainer_kwargs, tmp_path):
    """`save_checkpoint(weights_only=True)` runs no callback hook: the quantized model's own state-dict hook makes
    its torchao tensors portable, so Lightning's callable map_location loads them with no CheckpointIO swapped in."""
    from lightning_lowmem.callbacks import PostTrainingQuantization

    module = _quantized_checkpoint(tiny_trainer_kwargs, tmp_path / "full.ckpt", PLUGINS[plugins]())
    trainer = _trainer(tiny_trainer_kwargs, [PostTrainingQuantization("int8_weight_only")], PLUGINS[plugins]())
    trainer.validate(module, verbose=False)  # attach the module to a trainer to save it
    trainer.save_checkpoint(tmp_path / "bare.ckpt", weights_only=True)
    assert "lowmem_quantization" not in read_checkpoint(tmp_path / "bare.ckpt")  # no callback wrote a record
    fresh = Net()
    checker = _trainer(tiny_trainer_kwargs, [PostTrainingQuantization("int8_weight_only")], PLUGINS[plugins]())
    # failed before (Lightning's TorchCheckpointIO, without the swap): Callable map_location not supported
    checker.validate(fresh, ckpt_path=str(tmp_path / "bare.ckpt"), verbose=False)
    inputs = torch.randn(4, 32)
    assert is_quantized_tensor(fresh.net[0].weight) and torch.equal(fresh(inputs), module(inputs))
