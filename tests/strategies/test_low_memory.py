"""LowMemoryStrategy / LowMemoryDDPStrategy: registration, options, memory_budget, bad input."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from torch import nn

from lightning_lowmem.memory import format_bytes, measure_memory, track_memory
from lightning_lowmem.strategies import prefetch
from lightning_lowmem.strategies._options import set_expandable_segments
from lightning_lowmem.strategies.low_memory import LowMemoryDDPStrategy, LowMemoryStrategy
from lightning_lowmem.warnings import LowMemWarning


class _Wide(L.LightningModule):
    """An MLP whose training-step peak is mostly weights, gradients and AdamW state (26 MiB in fp32)."""

    def __init__(self, num_workers: int = 0) -> None:
        super().__init__()
        self.num_workers = num_workers
        self.net = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 64))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.05)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(512, 64, generator=generator), torch.randn(512, 64, generator=generator)
        )
        extra = {"num_workers": self.num_workers, "prefetch_factor": 4} if self.num_workers else {}
        return torch.utils.data.DataLoader(data, batch_size=256, **extra)


class _TrackTraining(L.Callback):
    """Measures every tensor allocated from the first to the last training step (after setup / planning)."""

    def on_train_start(self, trainer, pl_module):
        self._context = track_memory(pl_module, device="cpu")
        self.tracking = self._context.__enter__()

    def on_train_end(self, trainer, pl_module):
        self._context.__exit__(None, None, None)
        self.report = self.tracking.report


def _plain_peak_bytes() -> int:
    """The measured peak of one plain fp32 AdamW training step of `_Wide` (after a warm-up step)."""
    torch.manual_seed(0)
    model = _Wide()
    optimizer = model.configure_optimizers()
    batch = next(iter(model.train_dataloader()))

    def step():
        model.training_step(batch, 0).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on
    return measure_memory(step, module=model, optimizer=optimizer, device="cpu").peak_bytes


def test_registered_names_resolve():
    assert type(L.Trainer(strategy="lowmem", accelerator="cpu", logger=False).strategy) is LowMemoryStrategy
    ddp = L.Trainer(strategy="lowmem_ddp", accelerator="cpu", devices=2, logger=False).strategy
    assert type(ddp) is LowMemoryDDPStrategy
    assert ddp._ddp_kwargs["gradient_as_bucket_view"] is True and ddp._ddp_kwargs["bucket_cap_mb"] == 25


def test_fit_with_checkpointing_and_compression(tiny_trainer_kwargs):
    from lightning_lowmem.demo import CharLM, CharLMDataModule

    strategy = LowMemoryStrategy(
        activation_checkpointing="Block", activation_compression="int8", compression_min_bytes=0
    )
    model = CharLM(n_layer=2, n_embd=32, n_head=2, block_size=16)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = L.Trainer(strategy=strategy, max_steps=2, limit_val_batches=0, **tiny_trainer_kwargs)
    trainer.fit(model, CharLMDataModule(block_size=16, batch_size=4, max_chars=20_000))
    assert trainer.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert strategy.compression_stats.packed > 0 and strategy.compression_stats.ratio > 3  # int8 really applied
    assert strategy.checkpointed == []  # released in teardown
    assert "forward" not in vars(model.model.h[0])  # the checkpoint wrap was removed


class _RecordWrapped(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.wrapped = list(trainer.strategy.checkpointed)


def test_nested_checkpointing_wraps_attention_inside_blocks_and_keeps_the_weights(tiny_trainer_kwargs):
    """The strategy's nested policy is the callback's: same weights after training as without it (fp32)."""
    from lightning_lowmem.demo import CharLM, CharLMDataModule

    def fit(strategy):
        torch.manual_seed(0)
        model = CharLM(n_layer=2, n_embd=32, n_head=2, block_size=16)
        record = _RecordWrapped()
        trainer = L.Trainer(
            strategy=strategy, max_steps=2, limit_val_batches=0, callbacks=[record], **tiny_trainer_kwargs
        )
        trainer.fit(model, CharLMDataModule(block_size=16, batch_size=4, max_chars=20_000))
        return model, record.wrapped

    nested, wrapped = fit(LowMemoryStrategy(activation_checkpointing=["Block", "*.attn"], nested_checkpointing=True))
    plain, _ = fit(LowMemoryStrategy())
    assert wrapped == ["model.h.0", "model.h.0.attn", "model.h.1", "model.h.1.attn"]
    with pytest.raises(TypeError, match=r"`nested_checkpointing` must be True or False, got str: 'yes'"):
        LowMemoryStrategy(activation_checkpointing="Block", nested_checkpointing="yes")
    for a, b in zip(nested.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "fp8"}, r"`precision`='fp8' is not a known preset; choose one of \['32-true'"),
        ({"memory_budget": "12GB?"}, r"`memory_budget`='12GB\?' is not a byte size"),
        ({"memory_budget": "24"}, r"`memory_budget`='24' has no unit: did you mean '24GiB'\?"),
        ({"memory_budget": 24}, r"`memory_budget`=24 is 24 bytes: did you mean '24GiB'\?"),
        ({"activation_compression": "zip"}, r"`activation_compression`='zip' is unknown"),
        ({"optimizer": "adamw9bit"}, r"`optimizer`='adamw9bit' is unknown; choose one of \['adafactor'"),
        ({"compression_min_bytes": -1}, r"`compression_min_bytes`=-1 must be >= 0"),
        # one validation, in functional.config: the optimizer's signature, with a did-you-mean
        (
            {"optimizer": "adamw8bit", "optimizer_kwargs": {"betaz": [0.9, 0.99]}},
            r"`betaz` is not an argument of optimizer 'adamw8bit'; did you mean 'betas'\?",
        ),
        ({"activation_checkpointing": 0}, r"`activation_checkpointing`=0 must be >= 1"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LowMemoryStrategy(**kwargs)


def test_bad_ddp_input():
    with pytest.raises(ValueError, match=r"`bucket_cap_mb` must be a positive number, got -1"):
        LowMemoryDDPStrategy(bucket_cap_mb=-1)
    with pytest.raises(
        ValueError, match=r"`optimizer`='adamw_in_backward' steps inside backward and cannot be sharded"
    ):
        LowMemoryDDPStrategy(zero_optimizer=True, optimizer="adamw_in_backward")
    with pytest.raises(TypeError, match=r"`prefetch` must be True or False, got str: 'yes'"):
        LowMemoryDDPStrategy(prefetch="yes")


def test_zero_without_distributed_run_warns_and_falls_back():
    with pytest.warns(LowMemWarning, match="needs a distributed run.*falling back"):
        strategy = LowMemoryStrategy(zero_optimizer=True)
    assert strategy.zero_optimizer is False
    assert LowMemoryStrategy(memory_budget="12GiB").memory_budget_bytes == 12 * 2**30


def test_bf16_true_preset_trains_in_bf16(tiny_trainer_kwargs):
    from lightning_lowmem.demo import CharLM, CharLMDataModule

    model = CharLM(n_layer=1, n_embd=32, n_head=2, block_size=16)
    trainer = L.Trainer(
        strategy=LowMemoryStrategy(precision="bf16-true"), max_steps=1, limit_val_batches=0, **tiny_trainer_kwargs
    )
    trainer.fit(model, CharLMDataModule(block_size=16, batch_size=4, max_chars=20_000))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.slow  # torchao's optimizer compiles its step
def test_bf16_true_with_stochastic_rounding_optimizer_keeps_lr_and_weight_decay(tiny_trainer_kwargs):
    model = _Wide()
    strategy = LowMemoryStrategy(precision="bf16-true", optimizer="adamw_bf16_sr")
    trainer = L.Trainer(strategy=strategy, max_steps=2, **tiny_trainer_kwargs)
    trainer.fit(model)
    optimizer = trainer.optimizers[0]
    assert type(optimizer).__module__.startswith("torchao") and optimizer.bf16_stochastic_round is True
    assert optimizer.param_groups[0]["lr"] == 1e-3 and optimizer.param_groups[0]["weight_decay"] == 0.05
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert "configure_optimizers" not in vars(model)  # the swap is undone in teardown


def test_memory_budget_below_the_plain_peak_plans_and_stays_under_it(tiny_trainer_kwargs, caplog):
    plain_peak = _plain_peak_bytes()
    budget = int(0.75 * plain_peak)
    # optimizer fixed: plan_memory cannot estimate torchao's 8-bit AdamW on fake tensors yet
    strategy = LowMemoryStrategy(memory_budget=budget, optimizer="adamw")
    tracker = _TrackTraining()
    trainer = L.Trainer(strategy=strategy, max_steps=3, callbacks=[tracker], **tiny_trainer_kwargs)
    with caplog.at_level(logging.INFO):
        trainer.fit(_Wide())
    assert trainer.global_step == 3
    assert strategy.plan.config.precision_preset != "32-true"  # weights / state in 16 bits is what fits here
    assert strategy.plan.predicted_peak_bytes <= budget
    assert tracker.report.peak_bytes < budget < plain_peak
    assert f"memory_budget={format_bytes(budget)} -> [{strategy.plan.config.describe()}]" in caplog.text


def test_impossible_memory_budget_fails_before_training(tiny_trainer_kwargs):
    model = _Wide()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = L.Trainer(
        strategy=LowMemoryStrategy(memory_budget="64KiB", optimizer="adamw"), max_steps=1, **tiny_trainer_kwargs
    )
    with pytest.raises(ValueError, match=r"memory_budget='64KiB'.*no configuration fits.*smallest predicted peak is"):
        trainer.fit(model)
    assert trainer.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_dataloader_queue_above_the_threshold_warns_on_the_first_batch(tiny_trainer_kwargs, monkeypatch):
    monkeypatch.setattr(prefetch, "DATALOADER_WARN_BYTES", 768 * 2**10)
    trainer = L.Trainer(strategy=LowMemoryStrategy(), max_steps=1, **tiny_trainer_kwargs)
    # 4 batches in flight x 128 KiB (256 x (64 + 64) floats) = 512 KiB: fine
    trainer.fit(_Wide(num_workers=1))
    trainer = L.Trainer(strategy=LowMemoryStrategy(), max_steps=1, **tiny_trainer_kwargs)
    with pytest.warns(
        LowMemWarning,
        match=r"keeps about 1.00 MiB of batches in flight \(prefetch_factor=4 x num_workers=2 x 128.00 KiB per batch\), above 768.00 KiB",
    ):
        trainer.fit(_Wide(num_workers=2))


def test_prefetch_is_a_no_op_on_cpu(tiny_trainer_kwargs, caplog):
    trainer = L.Trainer(strategy=LowMemoryStrategy(prefetch=True), max_steps=1, **tiny_trainer_kwargs)
    with caplog.at_level(logging.INFO):
        trainer.fit(_Wide())
    assert "prefetch=True is a no-op on cpu" in caplog.text
    assert isinstance(trainer.train_dataloader, torch.utils.data.DataLoader)  # not wrapped


def test_expandable_segments_are_written_before_cuda_initialises(tiny_trainer_kwargs, monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False")
    trainer = L.Trainer(strategy=LowMemoryStrategy(expandable_segments=True), max_steps=1, **tiny_trainer_kwargs)
    trainer.fit(_Wide())
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(LowMemWarning, match=r"CUDA is already initialised in this process"):
        assert set_expandable_segments(False) is False
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"  # unchanged


def test_import_lightning_lowmem_registers_names_for_trainer_and_cli(tmp_path):
    """A fresh process: `import lightning_lowmem` (which must not import Lightning), then the CLI with
    `--trainer.strategy=lowmem`."""
    script = f"""
import sys
import lightning_lowmem
assert "lightning.pytorch" not in sys.modules, "import lightning_lowmem imported Lightning"
from lightning_lowmem.cli import main
main(["fit", "--model", "lightning_lowmem.demo.CharLM", "--model.n_layer", "1", "--model.n_embd", "32",
      "--model.n_head", "2", "--model.block_size", "16", "--data", "lightning_lowmem.demo.CharLMDataModule",
      "--data.block_size", "16", "--data.batch_size", "4", "--data.max_chars", "20000",
      "--trainer.strategy=lowmem", "--trainer.accelerator=cpu", "--trainer.fast_dev_run=true",
      "--trainer.default_root_dir={tmp_path}"])
import lightning as L
print(type(L.Trainer(strategy="lowmem_ddp_spawn", accelerator="cpu", devices=2).strategy).__name__)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("LowMemoryDDPStrategy")


class _ActivationHeavy(_Wide):
    """A wide MLP on big batches: activations, not weights, make its peak (what micro-batches shrink)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 64))
        self.rows_seen: list[int] = []

    def training_step(self, batch, batch_idx):
        self.rows_seen.append(batch[0].shape[0])
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(2048, 64, generator=generator), torch.randn(2048, 64, generator=generator)
        )
        return torch.utils.data.DataLoader(data, batch_size=1024)


def test_memory_budget_falls_back_to_micro_batches_when_whole_batches_cannot_fit(tiny_trainer_kwargs, caplog):
    from lightning_lowmem.planning.estimate import estimate_memory

    torch.manual_seed(0)
    model = _ActivationHeavy()
    batch = next(iter(model.train_dataloader()))
    fixed = dict(precision="32-true", optimizer="adamw", activation_compression="int8")
    whole = estimate_memory(model, batch, device="cpu", **{k: v for k, v in fixed.items()}).peak_bytes
    quarter = estimate_memory(model, batch, device="cpu", micro_batch_size=256, **fixed).peak_bytes
    budget = (whole + quarter) // 2
    reference = _ActivationHeavy()
    reference.load_state_dict(model.state_dict())

    strategy = LowMemoryStrategy(memory_budget=budget, **fixed)
    tracker = _TrackTraining()
    seen: list[list[L.Callback]] = []
    watch = L.pytorch.callbacks.LambdaCallback(
        on_train_batch_start=lambda trainer, *_: seen.append(list(trainer.callbacks))
    )
    trainer = L.Trainer(strategy=strategy, max_steps=2, callbacks=[tracker, watch], **tiny_trainer_kwargs)
    callbacks, before = trainer.callbacks, list(trainer.callbacks)
    with caplog.at_level(logging.INFO):
        trainer.fit(model)
    assert trainer.global_step == 2  # same optimizer steps as whole batches
    size = strategy.plan.config.micro_batch_size
    assert size in (512, 256) and strategy.config.microbatch.size == size
    assert set(model.rows_seen) == {size} and len(model.rows_seen) == 2 * 1024 // size  # run in micro-batches
    assert tracker.report.peak_bytes < budget < whole
    # failed before: the strategy appended an AutoMicrobatch callback to the Trainer's list while fitting
    assert trainer.callbacks is callbacks and seen == [before, before] and trainer.callbacks == before
    assert "training_step" not in vars(model) and "optimizer_zero_grad" not in vars(model)  # unwrapped

    plain = L.Trainer(strategy=LowMemoryStrategy(**fixed), max_steps=2, **tiny_trainer_kwargs)
    plain.fit(reference)  # the same effective batch without a budget: the same weights up to summation order
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_memory_budget_with_optimizer_in_backward_does_not_try_micro_batches(tiny_trainer_kwargs):
    trainer = L.Trainer(
        strategy=LowMemoryStrategy(memory_budget="64KiB", optimizer="adamw_in_backward"),
        max_steps=1,
        **tiny_trainer_kwargs,
    )
    with pytest.raises(ValueError, match=r"Micro-batches are not tried with optimizer='adamw_in_backward'"):
        trainer.fit(_Wide())


def test_optimizer_is_one_optimizer_config_and_optimizer_kwargs_is_a_deprecated_shorthand():
    from jsonargparse import ArgumentParser

    from lightning_lowmem.functional.config import OptimizerConfig

    wanted = OptimizerConfig("adamw8bit", lr=1e-3, betas=(0.9, 0.99))
    assert LowMemoryStrategy(optimizer=wanted).config.optimizer == wanted
    with pytest.warns(DeprecationWarning, match=r"`optimizer_kwargs`=.* is deprecated: .*OptimizerConfig\('adamw8bit'"):
        old = LowMemoryStrategy(optimizer="adamw8bit", optimizer_kwargs={"lr": 1e-3, "betas": [0.9, 0.99]})
    assert old.config.optimizer == wanted
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ValueError, match=r"`optimizer_kwargs`=.* needs `optimizer` as"),
    ):
        LowMemoryDDPStrategy(optimizer=wanted, optimizer_kwargs={"lr": 1.0})
    # the configured optimizer's arguments for the planner: no warning (there is no config to give instead)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert LowMemoryStrategy(optimizer_kwargs={"lr": 0.1}).optimizer_kwargs == {"lr": 0.1}
    # YAML (LightningCLI reads the signature): a mapping of the config's arguments
    parser = ArgumentParser()
    parser.add_class_arguments(LowMemoryStrategy, "strategy", skip={"device"})
    parsed = parser.parse_string(
        "strategy: {optimizer: {name: adamw8bit, hyperparameters: {lr: 0.001, betas: [0.9, 0.99]}}}"
    )
    assert parser.instantiate(parsed).strategy.config.optimizer == wanted
