"""LowMemoryStrategy / LowMemoryDDPStrategy: registration, options, bad input."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_lowmem.strategies.low_memory import LowMemoryDDPStrategy, LowMemoryStrategy
from lightning_lowmem.warnings import LowMemWarning


def test_registered_names_resolve():
    assert type(L.Trainer(strategy="lowmem", accelerator="cpu", logger=False).strategy) is LowMemoryStrategy
    ddp = L.Trainer(strategy="lowmem_ddp", accelerator="cpu", devices=2, logger=False).strategy
    assert type(ddp) is LowMemoryDDPStrategy
    assert ddp._ddp_kwargs["gradient_as_bucket_view"] is True and ddp._ddp_kwargs["bucket_cap_mb"] == 25


def test_fit_with_checkpointing_and_compression(tiny_trainer_kwargs):
    from lightning_lowmem.demo import CharLM, CharLMDataModule

    strategy = LowMemoryStrategy(activation_checkpointing="Block", activation_compression="int8")
    model = CharLM(n_layer=2, n_embd=32, n_head=2, block_size=16)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = L.Trainer(strategy=strategy, max_steps=2, limit_val_batches=0, **tiny_trainer_kwargs)
    trainer.fit(model, CharLMDataModule(block_size=16, batch_size=4, max_chars=20_000))
    assert trainer.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert strategy.checkpointed == []  # released in teardown
    assert "forward" not in vars(model.model.h[0])  # the checkpoint wrap was removed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "fp8"}, r"`precision`='fp8' is not a known preset; choose one of \['32-true'"),
        ({"memory_budget": "12GB?"}, r"`memory_budget`='12GB\?' is not a byte size"),
        ({"activation_compression": "zip"}, r"`activation_compression`='zip' is unknown"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LowMemoryStrategy(**kwargs)


def test_bad_bucket_size():
    with pytest.raises(ValueError, match=r"`bucket_cap_mb` must be a positive number, got -1"):
        LowMemoryDDPStrategy(bucket_cap_mb=-1)


def test_zero_without_distributed_run_warns_and_falls_back():
    with pytest.warns(LowMemWarning, match="needs a distributed run.*falling back"):
        strategy = LowMemoryStrategy(zero_optimizer=True)
    assert strategy.zero_optimizer is False
    assert LowMemoryStrategy(memory_budget="12GiB").memory_budget_bytes == 12 * 2**30


def test_bf16_true_preset_trains_in_bf16(tiny_trainer_kwargs):
    from lightning_lowmem.demo import CharLM, CharLMDataModule

    model = CharLM(n_layer=1, n_embd=32, n_head=2, block_size=16)
    trainer = L.Trainer(strategy=LowMemoryStrategy(precision="bf16-true"), max_steps=1, limit_val_batches=0,
                        **tiny_trainer_kwargs)
    trainer.fit(model, CharLMDataModule(block_size=16, batch_size=4, max_chars=20_000))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
