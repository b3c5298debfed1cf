"""The quantization callbacks on Hugging Face LightningModules: dict batches, Conv1D, tied weights, checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import lightning as L
import pytest
import torch
from torch import nn

from lightning_lowmem.callbacks.post_training_quantization import PostTrainingQuantization, load_quantized_checkpoint
from lightning_lowmem.callbacks.quantization_aware_training import QuantizationAwareTraining
from lightning_lowmem.model_io import BatchCallError
from lightning_lowmem.warnings import LowMemWarning

pytest.importorskip("transformers")

from lightning_lowmem.models.hf import HFLanguageModel  # noqa: E402
from tests.hf_zoo import T5_TABLES, constant_bytes, hf_data, hf_module, size_ratio, t5_tied_names  # noqa: E402

warnings.filterwarnings("ignore", module="torchao")


_DATA: dict[str, L.LightningDataModule] = {}


def data(family="gpt2"):
    """One data module per family for the whole file (its setup reads the corpus once)."""
    if family not in _DATA:
        _DATA[family] = hf_data(family, seq_len=16, batch_size=4)
    return _DATA[family]


def fit(module, callbacks, tiny_trainer_kwargs, family="gpt2", **kwargs):
    kwargs = {"max_steps": 1, "limit_val_batches": 2, "num_sanity_val_steps": 0, **tiny_trainer_kwargs, **kwargs}
    trainer = L.Trainer(callbacks=callbacks, **kwargs)
    trainer.fit(module, data(family))
    return trainer


def logits(module, batch):
    with torch.no_grad():
        return module(**batch).logits


def test_ptq_quantizes_every_family_timing_dict_batches(hf_family, tiny_trainer_kwargs):
    """Issue 16: `HFModule.forward() takes 1 positional argument but 2 were given` from the latency timing."""
    module = hf_module(hf_family)
    callback = PostTrainingQuantization("int8_dynamic", latency_batches=1)
    fit(module, [callback], tiny_trainer_kwargs, hf_family)
    before, after = callback.summary["before"], callback.summary["after"]
    assert before["latency_s"] > 0 and after["latency_s"] > 0  # timed through model(**batch)
    assert size_ratio(before["bytes"], after["bytes"], module) > 3.4
    report = callback.summary["report"]
    assert callback.quantized == sorted(report.converted)
    assert report.converted_bytes / (report.bytes_before - constant_bytes(module)) > 0.95
    if hf_family == "gpt2":
        assert len(callback.conv1d) == 8 and module.model.lm_head.weight is module.model.transformer.wte.weight


class PositionalOnly(HFLanguageModel):
    """A module whose forward takes one tensor while its batches are dicts: the package cannot call it."""

    def forward(self, input_ids):
        return self.model(input_ids=input_ids)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)


def test_batch_the_model_cannot_take_skips_latency_with_the_override_hint(tiny_trainer_kwargs):
    callback = PostTrainingQuantization("int8_weight_only", latency_batches=1)
    torch.manual_seed(0)
    with pytest.warns(LowMemWarning, match="latency column is not timed.*forward_batch\\(self, batch\\)"):
        fit(PositionalOnly(), [callback], tiny_trainer_kwargs)
    assert (
        callback.quantized and callback.summary["after"]["latency_s"] != callback.summary["after"]["latency_s"]
    )  # nan


def test_int8_static_with_a_batch_the_model_cannot_take_fails_at_the_first_batch(tiny_trainer_kwargs):
    callback = PostTrainingQuantization("int8_static", module_name="model", latency_batches=0)
    torch.manual_seed(0)
    module = PositionalOnly()
    with pytest.raises(BatchCallError, match="int8_static.*calibrates.*forward_batch\\(self, batch\\)"):
        trainer = L.Trainer(callbacks=[callback], max_steps=3, num_sanity_val_steps=0, **tiny_trainer_kwargs)
        trainer.fit(module, data("gpt2"))
    assert trainer.global_step == 0  # before any training, not after the whole fit


class WithForwardBatch(PositionalOnly):
    """The documented override point: how the package should run this model on a batch."""

    calls = 0

    def forward_batch(self, batch):
        WithForwardBatch.calls += 1
        return self(batch["input_ids"])


def test_forward_batch_override_is_used_for_latency_and_calibration(tiny_trainer_kwargs):
    torch.manual_seed(0)
    callback = PostTrainingQuantization("int8_weight_only", latency_batches=2)
    fit(WithForwardBatch(), [callback], tiny_trainer_kwargs)
    assert WithForwardBatch.calls >= 2 * (2 + 2)  # warmup + repeats, before and after
    assert callback.summary["after"]["latency_s"] > 0


def test_int4_weight_only_without_cuda_fails_at_setup(tiny_trainer_kwargs):
    """Issue 20: accepted, then failed only after the whole fit."""
    trainer = L.Trainer(callbacks=[PostTrainingQuantization("int4_weight_only")], max_steps=2, **tiny_trainer_kwargs)
    with pytest.raises(
        ValueError, match="`mode`='int4_weight_only' cannot run on this Trainer's device 'cpu'.*intx4_weight_only"
    ):
        trainer.fit(hf_module("llama"), data("llama"))
    assert trainer.global_step == 0


def test_skip_modules_naming_nothing_fails_at_setup(tiny_trainer_kwargs):
    trainer = L.Trainer(
        callbacks=[PostTrainingQuantization(skip_modules=["lm_haed"])], max_steps=2, **tiny_trainer_kwargs
    )
    with pytest.raises(ValueError, match="'lm_haed' matches no submodule of HFLanguageModel \\(did you mean 'lm_head'"):
        trainer.fit(hf_module("gpt2"), data("gpt2"))
    assert trainer.global_step == 0


@pytest.mark.slow
def test_int8_static_exports_gpt2_with_keyword_batches_and_conv1d(tiny_trainer_kwargs):
    module = hf_module("gpt2")
    callback = PostTrainingQuantization(
        "int8_static",
        module_name="model",
        latency_batches=0,
        calibration_batches=2,
        monitor="val_loss",
        monitor_mode="min",
        tolerance=0.05,
    )
    fit(module, [callback], tiny_trainer_kwargs)
    assert "model.transformer.h.0.attn.c_attn" in callback.quantized and len(callback.quantized) == 8
    assert "model.lm_head" not in callback.quantized  # tied to the float table: stays float, stored once
    assert type(module.model).__name__ == "StaticInt8Module"  # passes use_cache=False on every call
    assert callback.summary["met"] and callback.summary["kept_float"] == []
    before, after = callback.summary["before"]["metric"], callback.summary["after"]["metric"]
    assert 0 < after and abs(after - before) < 0.05
    results = L.Trainer(limit_val_batches=2, **tiny_trainer_kwargs).validate(module, data("gpt2"), verbose=False)
    assert results[0]["val_loss"] == pytest.approx(after, rel=1e-4)  # the installed graph is what was measured


class TiedLM(L.LightningModule):
    """Embedding 64 x 32 -> Linear 32 -> head tied to the table; ``val_err`` = MSE to the float outputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(64, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.wte.weight
        tokens = torch.randint(0, 64, (32, 4))
        with torch.no_grad():
            self.data = torch.utils.data.TensorDataset(tokens, self(tokens))

    def forward(self, x):
        return self.head(self.mid(self.wte(x)))

    def training_step(self, batch, batch_idx):
        return (self(batch[0]) - batch[1]).pow(2).mean() * 0.0

    def validation_step(self, batch, batch_idx):
        self.log("val_err", (self(batch[0]) - batch[1]).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=16)

    val_dataloader = train_dataloader


def test_tolerance_search_treats_a_tied_group_as_one_candidate(tiny_trainer_kwargs):
    callback = PostTrainingQuantization(
        "int8_dynamic", monitor="val_err", monitor_mode="min", tolerance=0.0, latency_batches=0
    )
    module = TiedLM()
    with pytest.warns(LowMemWarning, match="no configuration keeps 'val_err'.*per-layer drops: wte: .*, mid: "):
        L.Trainer(callbacks=[callback], max_steps=1, num_sanity_val_steps=0, **tiny_trainer_kwargs).fit(module)
    assert set(callback.summary["kept_float"]) == {"wte", "mid", "head"}
    assert module.head.weight is module.wte.weight and type(module.wte.weight) is nn.Parameter  # put back tied
    callback = PostTrainingQuantization(
        "int8_dynamic", monitor="val_err", monitor_mode="min", tolerance=1.0, latency_batches=0
    )
    module = TiedLM()
    L.Trainer(callbacks=[callback], max_steps=1, num_sanity_val_steps=0, **tiny_trainer_kwargs).fit(module)
    assert callback.quantized == ["head", "mid", "wte"] and callback.tied == [["wte", "head"]]
    assert module.head.weight is module.wte.weight


@pytest.fixture
def gpt2_checkpoint(tiny_trainer_kwargs, tmp_path):
    module = hf_module("gpt2")
    trainer = fit(module, [PostTrainingQuantization("int8_dynamic", latency_batches=0)], tiny_trainer_kwargs)
    path = str(tmp_path / "quantized.ckpt")
    trainer.save_checkpoint(path)
    return module.eval(), path


def test_quantized_checkpoint_without_the_callback_says_what_to_add(gpt2_checkpoint, tiny_trainer_kwargs):
    """Issue 20: `Callable map_location not supported with _rebuild_wrapper_subclass` from a plain Trainer."""
    _, path = gpt2_checkpoint
    instruction = r"written by lightning_lowmem PostTrainingQuantization\(mode='int8_dynamic'\): add it to the Trainer's callbacks"
    with pytest.raises(RuntimeError, match=instruction):
        L.Trainer(limit_val_batches=1, **tiny_trainer_kwargs).validate(
            hf_module("gpt2"), data("gpt2"), ckpt_path=path, verbose=False
        )
    with pytest.raises(RuntimeError, match=instruction):
        HFLanguageModel.load_from_checkpoint(path)


def test_quantized_checkpoint_back_through_ckpt_path_and_load_quantized_checkpoint(
    gpt2_checkpoint, tiny_trainer_kwargs
):
    module, path = gpt2_checkpoint
    data("gpt2").setup("fit")
    batch = next(iter(data("gpt2").val_dataloader()))
    expected = logits(module, batch)
    fresh = hf_module("gpt2", seed=1)
    callback = PostTrainingQuantization("intx4_weight_only")  # another mode: the checkpoint says what it holds
    L.Trainer(callbacks=[callback], limit_val_batches=1, **tiny_trainer_kwargs).validate(
        fresh, data("gpt2"), ckpt_path=path, verbose=False
    )
    fresh.eval()
    assert type(fresh.model.transformer.h[0].attn.c_attn).__name__ == "Linear"
    assert type(fresh.model.transformer.h[0].attn.c_attn.weight).__name__ == "Int8Tensor"
    assert fresh.model.lm_head.weight is fresh.model.transformer.wte.weight  # tied again
    assert torch.equal(logits(fresh, batch), expected)
    assert len(callback.conv1d) == 8
    loaded = load_quantized_checkpoint(HFLanguageModel, path, weights_only=True).eval()
    assert torch.equal(logits(loaded, batch), expected)


def test_quantized_checkpoint_loads_weights_only_after_import_lightning_lowmem(gpt2_checkpoint):
    _, path = gpt2_checkpoint
    code = (
        "import sys, lightning_lowmem, torch; assert 'torchao' not in sys.modules; "
        f"state = torch.load({path!r}, weights_only=True, map_location=lambda storage, loc: storage)['state_dict']; "
        "print(type(state['model.transformer.h.0.attn.c_attn.weight']).__name__)"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("Int8Tensor")


def test_qat_on_gpt2_trains_conv1d_fake_quantized_and_converts_tied_head_once(tiny_trainer_kwargs, tmp_path):
    module = hf_module("gpt2")
    callback = QuantizationAwareTraining("int8_weight_only")
    trainer = fit(module, [callback], tiny_trainer_kwargs, max_steps=2)
    assert len(callback.conv1d) == 8 and "model.lm_head" in callback.prepared
    report = callback.report
    assert ["model.transformer.wte", "model.lm_head"] in report.tied
    assert module.model.lm_head.weight is module.model.transformer.wte.weight
    assert type(module.model.transformer.h[0].mlp.c_fc.weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert (
        size_ratio(report.bytes_before, report.bytes_after, module) > 2.6
    )  # QAT leaves the untied position table (wpe) float
    path = str(tmp_path / "qat.ckpt")
    trainer.save_checkpoint(path)
    with pytest.raises(
        RuntimeError, match=r"written by lightning_lowmem QuantizationAwareTraining\(mode='int8_weight_only'\)"
    ):
        L.Trainer(limit_val_batches=1, **tiny_trainer_kwargs).validate(
            hf_module("gpt2"), data("gpt2"), ckpt_path=path, verbose=False
        )
    fresh = hf_module("gpt2", seed=1)
    tester = L.Trainer(
        callbacks=[QuantizationAwareTraining("int8_weight_only")], limit_val_batches=1, **tiny_trainer_kwargs
    )
    tester.validate(fresh, data("gpt2"), ckpt_path=path, verbose=False)
    assert fresh.model.lm_head.weight is fresh.model.transformer.wte.weight
    assert torch.equal(
        fresh.model.transformer.h[0].mlp.c_fc.weight.qdata, module.model.transformer.h[0].mlp.c_fc.weight.qdata
    )


def test_qat_on_t5_converts_the_four_way_tie_once(tiny_trainer_kwargs):
    module = hf_module("t5")
    callback = QuantizationAwareTraining("intx4_weight_only")
    fit(module, [callback], tiny_trainer_kwargs, family="t5")
    assert callback.report.tied == [t5_tied_names()]  # four names on transformers 5, two on 4.x
    assert len({id(module.get_submodule(name).weight) for name in T5_TABLES}) == 1  # one tensor under all four
    assert callback.report.size_ratio > 3.0


def test_weights_only_lightning_checkpoint_of_quantized_gpt2_loads_through_the_callback(
    gpt2_checkpoint, tiny_trainer_kwargs, tmp_path
):
    """`save_checkpoint(weights_only=True)` skips callbacks' hooks: no record, torchao's own pickling."""
    module, path = gpt2_checkpoint
    trainer = L.Trainer(callbacks=[PostTrainingQuantization()], limit_val_batches=1, **tiny_trainer_kwargs)
    trainer.validate(module, data("gpt2"), verbose=False)  # attach the module to a trainer to save it
    bare = str(tmp_path / "weights_only.ckpt")
    trainer.save_checkpoint(bare, weights_only=True)
    fresh = hf_module("gpt2", seed=1)
    tester = L.Trainer(callbacks=[PostTrainingQuantization()], limit_val_batches=1, **tiny_trainer_kwargs)
    tester.validate(fresh, data("gpt2"), ckpt_path=bare, verbose=False)
    fresh.eval()
    assert type(fresh.model.transformer.h[0].attn.c_proj).__name__ == "Linear"  # inferred: quantized => saved as Linear
    data("gpt2").setup("fit")
    batch = next(iter(data("gpt2").val_dataloader()))
    assert torch.equal(logits(fresh, batch), logits(module, batch))
