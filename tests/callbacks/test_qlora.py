"""QLoRA through ``LowRankAdapters`` in real fits: its peak below LoRA's on every Hugging Face family of the test
zoo (int8 and NF4 bases, measured by ``MemoryMonitor``), the base quantized in the dtype the Trainer trains in, and
an NF4 run's adapters-only checkpoint resuming exactly."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_lowmem import MemoryMonitor
from lightning_lowmem.callbacks.low_rank_adapters import LowRankAdapters
from lightning_lowmem.demo.charlm import BlockDataset, CharLM
from lightning_lowmem.functional.lora.files import load_adapters, lora_state_dict
from lightning_lowmem.functional.lora.quantized_base import is_nf4

hf_zoo = pytest.importorskip("tests.hf_zoo", reason="needs transformers")
warnings.filterwarnings("ignore", message=".*Enum subclass.*")

# width 512 (weights matter next to activations), one block: the zoo's families at a shape QLoRA is for
WIDE = {
    "gpt2": dict(n_embd=512, n_layer=1, n_head=8),
    "llama": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=8),
    "bert": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=8),
    "t5": dict(d_model=512, d_ff=1024, d_kv=64, num_heads=8, num_layers=1),
}


def _peak(family: str, quantize_base: str | None, tmp_path) -> int:
    module = hf_zoo.hf_module(family, **WIDE[family])
    lora = dict(r=8) if quantize_base is None else dict(r=8, quantize_base=quantize_base, quantize_frozen=True)
    monitor = MemoryMonitor(summary=False)
    trainer = L.Trainer(
        precision="bf16-true",
        max_steps=2,
        callbacks=[LowRankAdapters(**lora), monitor],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, hf_zoo.hf_data(family, seq_len=32, batch_size=2))
    return monitor.last_report.peak_bytes


def test_qlora_peaks_below_lora_on_every_family(hf_family, tmp_path):
    lora = _peak(hf_family, None, tmp_path)
    int8, nf4 = _peak(hf_family, "int8", tmp_path), _peak(hf_family, "nf4", tmp_path)
    assert nf4 < int8 < lora, (hf_family, lora, int8, nf4)


def test_the_base_is_quantized_in_the_dtype_the_trainer_trains_in(tiny_trainer_kwargs):
    module = hf_zoo.hf_module("llama", **WIDE["llama"])
    callback = LowRankAdapters(r=4, target=["q_proj"], quantize_base="int8", quantize_frozen=True)
    trainer = L.Trainer(**tiny_trainer_kwargs, precision="bf16-true", max_steps=1, callbacks=[callback])
    trainer.fit(module, hf_zoo.hf_data("llama", seq_len=16, batch_size=2))
    layer = module.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.dtype == torch.bfloat16  # quantized from bf16, not float32
    assert (
        layer.mlp.up_proj.weight.dtype == torch.bfloat16 and type(layer.mlp.up_proj).__name__ == "FrozenQuantizedLinear"
    )


def _charlm() -> CharLM:
    torch.manual_seed(0)
    return CharLM(n_layer=2, n_head=2, n_embd=64, block_size=16, lr=1e-2)


def _loader() -> DataLoader:
    data = torch.randint(0, 256, (16 * 8 * 4 + 1,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    return DataLoader(BlockDataset(data, 16), batch_size=8, shuffle=False)  # fixed order: exact resume


def _fit(model, kwargs, callbacks, ckpt_path=None, **trainer_args) -> L.Trainer:
    trainer = L.Trainer(**{**kwargs, **trainer_args}, precision="bf16-true", callbacks=callbacks, limit_val_batches=0)
    trainer.fit(model, train_dataloaders=_loader(), ckpt_path=ckpt_path)
    return trainer


def test_nf4_checkpoint_holds_adapters_and_resume_equals_uninterrupted(tiny_trainer_kwargs, tmp_path):
    settings = dict(r=4, quantize_base="nf4")  # the adapted layers in NF4 (load_adapters rebuilds those)
    uninterrupted = _charlm()
    _fit(uninterrupted, tiny_trainer_kwargs, [LowRankAdapters(**settings)], max_epochs=2, limit_train_batches=3)
    assert is_nf4(uninterrupted.model.h[0].attn.c_attn.weight)

    first = _charlm()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    kwargs = {**tiny_trainer_kwargs, "enable_checkpointing": True}
    _fit(first, kwargs, [LowRankAdapters(**settings), saver], max_epochs=1, limit_train_batches=3)
    path = next((tmp_path / "ckpt").glob("*.ckpt"))
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert set(saved["state_dict"]) == set(lora_state_dict(first))  # adapters only: no NF4 tensor saved
    assert saved["callbacks"]["LowRankAdapters"]["lora_config"]["quantize_base"] == "nf4"

    resumed = _charlm()
    trainer = _fit(
        resumed, tiny_trainer_kwargs, [LowRankAdapters(**settings)], path, max_epochs=2, limit_train_batches=3
    )
    assert trainer.global_step == 6
    for key, value in lora_state_dict(uninterrupted).items():
        assert value.abs().sum() > 0 and torch.equal(lora_state_dict(resumed)[key], value), key

    fresh = _charlm().bfloat16()  # a fresh bf16 base: load_adapters quantizes it to NF4 as the run did
    report = load_adapters(fresh, path)
    assert report.quantize_base == "nf4" and is_nf4(fresh.model.h[0].attn.c_attn.weight)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), first(tokens), atol=0, rtol=0)


def test_a_failed_setup_gives_back_the_float32_weights_the_bf16_conversion_replaced(tmp_path):
    """QLoRA converts the module to the training dtype before quantizing; a later callback failing in setup
    leaves the module as it was: float32, bit for bit (the conversion is undone with the adapters)."""
    from lightning_lowmem import ActivationCheckpointing
    from lightning_lowmem.demo import CharLMDataModule

    model = CharLM(n_layer=2, n_embd=64, block_size=32)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = L.Trainer(
        max_steps=1,
        precision="bf16-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        callbacks=[LowRankAdapters(r=4, quantize_base="nf4"), ActivationCheckpointing("NoSuchBlock")],
    )
    with pytest.raises(ValueError, match="matched no submodule"):
        trainer.fit(model, CharLMDataModule(batch_size=4, block_size=32))
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
