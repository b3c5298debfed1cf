"""PostTrainingQuantization: conversion at fit end, accuracy tolerance, checkpoints, bad input."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_lowmem.callbacks.post_training_quantization import (
    PostTrainingQuantization,
    load_quantized_checkpoint,
    quantize_like_checkpoint,
)
from lightning_lowmem.warnings import LowMemWarning, NoEffectWarning

warnings.filterwarnings("ignore", module="torchao")


class ErrorModule(L.LightningModule):
    """Linear 64 -> 64 -> 4; ``val_err`` = MSE to the float model's own outputs (0 before quantizing)."""

    def __init__(self, outlier: float = 50.0, log_metric: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 4)
        with torch.no_grad():
            self.fc2.weight[:, ::32] = outlier  # one outlier per int4 group: large int4 errors
        inputs = torch.randn(32, 64)
        with torch.no_grad():
            targets = self(inputs)
        self.data = TensorDataset(inputs, targets)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1]) * 0.0  # keep the weights (and the reference) fixed

    def validation_step(self, batch, batch_idx):
        if self.hparams.log_metric:
            self.log("val_err", F.mse_loss(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=16)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=16)


def fit(callback, tiny_trainer_kwargs, module=None, **kwargs):
    module = module or ErrorModule()
    trainer = L.Trainer(callbacks=[callback], max_steps=1, num_sanity_val_steps=0, **{**tiny_trainer_kwargs, **kwargs})
    trainer.fit(module)
    return trainer, module


def test_quantizes_all_linears_at_fit_end(tiny_trainer_kwargs):
    callback = PostTrainingQuantization("int8_weight_only", latency_batches=2)
    _, module = fit(callback, tiny_trainer_kwargs)
    assert callback.quantized == ["fc1", "fc2"]
    assert type(module.fc1.weight).__name__ == "Int8Tensor"
    assert callback.summary["after"]["bytes"] < callback.summary["before"]["bytes"] / 2.5


def test_tight_tolerance_keeps_sensitive_layer_float(tiny_trainer_kwargs):
    callback = PostTrainingQuantization("intx4_weight_only", monitor="val_err", monitor_mode="min", tolerance=2.5)
    _, module = fit(callback, tiny_trainer_kwargs)
    # measured drops: fc1 alone ~1.8, fc2 alone ~2.1, both ~4.3
    assert callback.summary["met"] and callback.summary["kept_float"] == ["fc2"]
    assert type(module.fc2.weight) is nn.Parameter and type(module.fc1.weight).__name__ == "IntxUnpackedToInt8Tensor"
    drop = callback.summary["after"]["metric"] - callback.summary["before"]["metric"]
    assert 0 < drop <= 2.5


def test_the_search_is_the_functional_workflow(tiny_trainer_kwargs, monkeypatch):
    """#27: the callback decides when and supplies `evaluate` (its validation_step); quantize_within_tolerance
    does the work, and on a plain module with a plain evaluate it chooses the same layers."""
    import lightning_lowmem.callbacks.post_training_quantization as ptq_callback
    from lightning_lowmem.functional.config import QuantizationConfig
    from lightning_lowmem.functional.quantization.tolerance import quantize_within_tolerance

    calls = []

    def spy(module, config, evaluate, tolerance, **kwargs):
        calls.append((config, tolerance, kwargs["higher_is_better"]))
        return quantize_within_tolerance(module, config, evaluate, tolerance, **kwargs)

    monkeypatch.setattr(ptq_callback, "quantize_within_tolerance", spy)
    callback = PostTrainingQuantization("intx4_weight_only", monitor="val_err", monitor_mode="min", tolerance=2.5)
    fit(callback, tiny_trainer_kwargs)
    assert calls == [(QuantizationConfig("intx4_weight_only"), 2.5, False)]
    assert callback.summary["kept_float"] == ["fc2"]

    plain = ErrorModule()  # no Trainer: the same metric, computed by hand
    inputs, targets = plain.data.tensors

    def val_err(module):
        with torch.no_grad():
            return float(F.mse_loss(module(inputs), targets))

    outcome = quantize_within_tolerance(plain, "intx4_weight_only", val_err, 2.5, higher_is_better=False)
    assert outcome.met and outcome.quantized == ["fc1"] and outcome.kept_float == ["fc2"]
    assert outcome.sensitivity == pytest.approx({"fc1": 1.8, "fc2": 2.1}, abs=0.3)  # the drops the test above measured


def test_zero_tolerance_refuses_and_leaves_model_float(tiny_trainer_kwargs):
    callback = PostTrainingQuantization("intx4_weight_only", monitor="val_err", monitor_mode="min", tolerance=0.0)
    with pytest.warns(LowMemWarning, match="no configuration keeps 'val_err' within tolerance"):
        _, module = fit(callback, tiny_trainer_kwargs)
    assert not callback.summary["met"] and callback.quantized == []
    assert all(type(p) is nn.Parameter for p in module.parameters())  # nothing half-converted


def test_monitor_never_logged_raises(tiny_trainer_kwargs):
    callback = PostTrainingQuantization("int8_dynamic", monitor="val_acc", tolerance=0.01)
    with pytest.raises(ValueError, match="`monitor`='val_acc' was never logged"):
        fit(callback, tiny_trainer_kwargs, module=ErrorModule(log_metric=False))


def test_no_quantizable_layer_warns(tiny_trainer_kwargs):
    callback = PostTrainingQuantization("int8_dynamic", skip_modules=["fc1", "fc2"])
    with pytest.warns(NoEffectWarning, match="found no quantizable nn.Linear"):
        fit(callback, tiny_trainer_kwargs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="`mode`='int2' is not a known"):
        PostTrainingQuantization("int2")
    with pytest.raises(ValueError, match="`tolerance`=0.01 needs `monitor`"):
        PostTrainingQuantization(tolerance=0.01)
    with pytest.raises(ValueError, match="`monitor_mode`='up' must be"):
        PostTrainingQuantization(monitor_mode="up")
    with pytest.raises(ValueError, match="`mode`='int8_static' needs `module_name`"):
        PostTrainingQuantization("int8_static")
    with pytest.raises(ValueError, match="`compile`=True apply to mode='int8_static' only.*compile_inference"):
        PostTrainingQuantization("int8_dynamic", compile=True)
    with pytest.raises(ValueError, match="`calibration_batches` must be an int > 0, got 0"):
        PostTrainingQuantization("int8_static", module_name="model", calibration_batches=0)


@pytest.mark.parametrize("mode", ["int8_dynamic", "intx4_weight_only"])
def test_checkpoint_restores_quantized_model(mode, tiny_trainer_kwargs, tmp_path):
    callback = PostTrainingQuantization(mode, latency_batches=0)
    trainer, module = fit(callback, tiny_trainer_kwargs)
    path = str(tmp_path / "quantized.ckpt")
    trainer.save_checkpoint(path)
    inputs = torch.randn(4, 64)
    expected = module(inputs)
    loaded = load_quantized_checkpoint(ErrorModule, path, weights_only=False)
    assert torch.allclose(loaded(inputs), expected, atol=1e-6)


def with_torchao_zero_points(path, out_path):
    """Rewrite a saved checkpoint as torchao's defaults store it: an all-zero zero point per int8 row (pickled
    portably, as the callbacks write it)."""
    from lightning_lowmem.functional.quantization.serialization import make_portable

    checkpoint = torch.load(path, weights_only=True)
    for value in checkpoint["state_dict"].values():
        if type(value).__name__ == "Int8Tensor":
            value.zero_point = torch.zeros_like(value.scale, dtype=torch.int8)
            make_portable(value)
    torch.save(checkpoint, out_path)
    return str(out_path)


def test_trainer_ckpt_path_restores_quantized_model(tiny_trainer_kwargs, tmp_path):
    trainer, module = fit(PostTrainingQuantization("int8_dynamic", latency_batches=0), tiny_trainer_kwargs)
    path = str(tmp_path / "quantized.ckpt")
    trainer.save_checkpoint(path)
    inputs = torch.randn(4, 64)
    for ckpt_path in (path, with_torchao_zero_points(path, tmp_path / "torchao_defaults.ckpt")):
        fresh = ErrorModule()
        callback = PostTrainingQuantization("int8_dynamic", latency_batches=0)
        checker = L.Trainer(callbacks=[callback], **tiny_trainer_kwargs)
        results = checker.validate(fresh, ckpt_path=ckpt_path, verbose=False)
        assert type(fresh.fc1.weight).__name__ == "Int8Tensor" and fresh.fc1.weight.zero_point is None
        assert torch.equal(fresh(inputs), module(inputs)) and results[0]["val_err"] > 0
        assert callback.quantized == ["fc1", "fc2"]
        assert type(checker.strategy.checkpoint_io).__name__ == "TorchCheckpointIO"  # never swapped
        expected = module(inputs)
        trainer.validate(module, ckpt_path=ckpt_path, verbose=False)  # into the already quantized model
        assert torch.equal(module(inputs), expected) and module.fc2.weight.zero_point is None


class LoadsQuantized(ErrorModule):
    def on_load_checkpoint(self, checkpoint):
        quantize_like_checkpoint(self, checkpoint)


def test_load_from_checkpoint_with_quantize_like_checkpoint(tiny_trainer_kwargs, tmp_path):
    trainer, module = fit(
        PostTrainingQuantization("int8_weight_only", latency_batches=0), tiny_trainer_kwargs, module=LoadsQuantized()
    )
    path = str(tmp_path / "quantized.ckpt")
    trainer.save_checkpoint(path)
    inputs = torch.randn(4, 64)
    for ckpt_path in (path, with_torchao_zero_points(path, tmp_path / "torchao_defaults.ckpt")):
        loaded = LoadsQuantized.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=True)
        assert type(loaded.fc2.weight).__name__ == "Int8Tensor"
        assert torch.equal(loaded(inputs), module(inputs))
        again = torch.load(ckpt_path, weights_only=True)
        assert quantize_like_checkpoint(loaded, again) == [
            "fc1",
            "fc2",
        ]  # quantized layers take the checkpoint's tensors
        loaded.load_state_dict(again["state_dict"])
        assert torch.equal(loaded(inputs), module(inputs))
    float_checkpoint = {"state_dict": ErrorModule().state_dict()}
    assert quantize_like_checkpoint(ErrorModule(), float_checkpoint) == []


class WrapsModel(ErrorModule):
    """ErrorModule whose layers sit in a child ``model`` (what int8_static replaces); ``forward`` scales
    its input by 2, so the child's calibration inputs differ from the batches."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        inputs = torch.randn(32, 64)
        with torch.no_grad():
            self.data = TensorDataset(inputs, self(inputs))

    def forward(self, x):
        return self.model(2 * x)

    def validation_step(self, batch, batch_idx):
        self.log("val_err", F.mse_loss(self(batch[0]), batch[1]))


def test_int8_static_replaces_child_by_calibrated_int8_graph(tiny_trainer_kwargs):
    callback = PostTrainingQuantization(
        "int8_static", module_name="model", monitor="val_err", monitor_mode="min", tolerance=1.0, latency_batches=2
    )
    module = WrapsModel()
    inputs = module.data.tensors[0]
    expected = module(inputs).detach()
    trainer, module = fit(callback, tiny_trainer_kwargs, module=module)
    assert callback.summary["met"] and callback.quantized == ["model.0", "model.2"]
    assert isinstance(module.model, torch.fx.GraphModule)
    assert sum(t.dtype == torch.int8 for t in module.model.state_dict().values()) == 2
    assert float((module(inputs).detach() - expected).norm() / expected.norm()) < 0.05  # calibrated on 2 * x, not x
    assert callback.summary["after"]["bytes"] < callback.summary["before"]["bytes"] / 2.5
    assert trainer.validate(module, verbose=False)[0]["val_err"] < 1.0  # Lightning's eval()/train() work on it


def test_int8_static_compile_wraps_graph_and_bad_module_name(tiny_trainer_kwargs):
    from lightning_lowmem.functional.quantization.compile import CompiledInference

    callback = PostTrainingQuantization("int8_static", module_name="model", compile=True, latency_batches=0)
    _, module = fit(callback, tiny_trainer_kwargs, module=WrapsModel())
    assert isinstance(module.model, CompiledInference)  # compiled at its first call (see functional tests)
    with pytest.raises(ValueError, match="`module_name`='net' is not a submodule of WrapsModel; its children are"):
        fit(PostTrainingQuantization("int8_static", module_name="net"), tiny_trainer_kwargs, module=WrapsModel())


def test_int8_static_checkpoint_is_refused_by_loader(tiny_trainer_kwargs, tmp_path):
    trainer, _ = fit(
        PostTrainingQuantization("int8_static", module_name="model", latency_batches=0),
        tiny_trainer_kwargs,
        module=WrapsModel(),
    )
    path = str(tmp_path / "static.ckpt")
    trainer.save_checkpoint(path)
    with pytest.raises(ValueError, match="int8_static.*Load the float checkpoint"):
        load_quantized_checkpoint(WrapsModel, path, weights_only=False)


class TokenModule(ErrorModule):
    """Embedding 64 x 64 -> Linear 64 -> 8 on token ids; ``val_err`` = MSE to the float model's outputs."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.wte = nn.Embedding(64, 64)
        self.head = nn.Linear(64, 8)
        tokens = torch.randint(0, 64, (32, 4))
        with torch.no_grad():
            self.data = TensorDataset(tokens, self(tokens))

    def forward(self, x):
        return self.head(self.wte(x))

    def validation_step(self, batch, batch_idx):
        self.log("val_err", F.mse_loss(self(batch[0]), batch[1]))


def test_embeddings_quantized_by_default_and_checkpoint_round_trips(tiny_trainer_kwargs, tmp_path):
    callback = PostTrainingQuantization("int8_dynamic", monitor="val_err", monitor_mode="min", tolerance=1e-3)
    trainer, module = fit(callback, tiny_trainer_kwargs, module=TokenModule())
    assert callback.summary["met"] and callback.quantized == ["head", "wte"]
    assert type(module.wte.weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert callback.summary["after"]["bytes"] < callback.summary["before"]["bytes"] / 3.5
    path = str(tmp_path / "quantized.ckpt")
    trainer.save_checkpoint(path)
    tokens = torch.randint(0, 64, (4, 4))
    loaded = load_quantized_checkpoint(TokenModule, path, weights_only=True)
    assert type(loaded.wte.weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert torch.allclose(loaded(tokens), module(tokens), atol=1e-6)


def test_embeddings_false_keeps_table_float(tiny_trainer_kwargs):
    callback = PostTrainingQuantization("int8_weight_only", embeddings=False, latency_batches=0)
    _, module = fit(callback, tiny_trainer_kwargs, module=TokenModule())
    assert callback.quantized == ["head"] and type(module.wte.weight) is nn.Parameter


def test_zero_tolerance_restores_float_embedding_after_search(tiny_trainer_kwargs):
    callback = PostTrainingQuantization("int8_dynamic", monitor="val_err", monitor_mode="min", tolerance=0.0)
    with pytest.warns(LowMemWarning, match="no configuration keeps 'val_err' within tolerance"):
        _, module = fit(callback, tiny_trainer_kwargs, module=TokenModule())
    assert set(callback.summary["kept_float"]) == {"head", "wte"}
    assert all(type(p) is nn.Parameter for p in module.parameters())  # each evaluation put the float table back


def test_embeddings_argument_errors_and_yaml():
    from jsonargparse import ArgumentParser

    with pytest.raises(ValueError, match="`embeddings`=True is not supported with mode='int8_static'"):
        PostTrainingQuantization("int8_static", module_name="model", embeddings=True)
    with pytest.raises(TypeError, match="`embeddings` must be True, False or None.*got 1"):
        PostTrainingQuantization("int8_dynamic", embeddings=1)
    parser = ArgumentParser()
    parser.add_class_arguments(PostTrainingQuantization, "ptq")
    config = parser.parse_string("ptq: {mode: int8_weight_only, embeddings: false}")
    assert parser.instantiate(config).ptq.embeddings is False


def test_table_says_when_quantized_is_slower():
    """Issue 20: eager int8_dynamic measured 14.7x slower than float with nothing said."""
    from lightning_lowmem.functional.quantization.report import comparison_table

    table = comparison_table(
        "int8_dynamic", {"bytes": 4000, "latency_s": 0.22e-3}, {"bytes": 1000, "latency_s": 3.2e-3}, []
    )
    assert "14.5x SLOWER than float" in table and "int8_static" in table and "compile=True" in table
    faster = comparison_table(
        "int8_dynamic", {"bytes": 4000, "latency_s": 2e-3}, {"bytes": 1000, "latency_s": 1e-3}, []
    )
    assert "SLOWER" not in faster


def test_checkpoint_records_its_writer(tiny_trainer_kwargs, tmp_path):
    trainer, _ = fit(PostTrainingQuantization("int8_weight_only", latency_batches=0), tiny_trainer_kwargs)
    path = str(tmp_path / "quantized.ckpt")
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["lowmem_quantization"]["writer"] == "PostTrainingQuantization(mode='int8_weight_only')"
    assert checkpoint["lowmem_quantization"]["quantized"] == ["fc1", "fc2"]
    instruction = [key for key in checkpoint["state_dict"] if key.startswith("lowmem_quantization:")]
    assert len(instruction) == 1 and "add it to the Trainer's callbacks" in instruction[0]
    with pytest.raises(RuntimeError, match="Unexpected key.*written by lightning_lowmem PostTrainingQuantization"):
        ErrorModule().load_state_dict(checkpoint["state_dict"])  # a plain load: stops before using anything


def test_the_quantized_model_is_saved_where_the_checkpoints_go(tiny_trainer_kwargs, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = PostTrainingQuantization("int8_weight_only", latency_batches=0)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    kwargs = {**tiny_trainer_kwargs, "enable_checkpointing": True}
    trainer = L.Trainer(callbacks=[checkpoints, callback], max_steps=1, num_sanity_val_steps=0, **kwargs)
    module = ErrorModule()
    trainer.fit(module)
    path = tmp_path / "ckpt" / "quantized.ckpt"
    assert callback.saved_path == str(path) and path.is_file()  # was: only the float epoch=0-step=1.ckpt
    inputs = torch.randn(4, 64)
    loaded = load_quantized_checkpoint(ErrorModule, path)  # weights_only=True: the portable form
    assert type(loaded.fc1.weight).__name__ == "Int8Tensor"
    torch.testing.assert_close(loaded(inputs), module(inputs), atol=0, rtol=0)
    float_checkpoint = torch.load(next(p for p in (tmp_path / "ckpt").glob("epoch*.ckpt")), weights_only=False)
    assert type(float_checkpoint["state_dict"]["fc1.weight"]) is torch.Tensor  # why the extra file is needed


def test_no_checkpoint_folder_no_quantized_file(tiny_trainer_kwargs, tmp_path):
    callback = PostTrainingQuantization("int8_weight_only", latency_batches=0)
    fit(callback, tiny_trainer_kwargs)  # enable_checkpointing=False
    assert callback.saved_path is None and not list(tmp_path.rglob("*.ckpt"))
