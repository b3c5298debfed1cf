"""LowMemoryStrategy(memory_budget=): the measured fit peak stays within the budget on models we did not write,
and the strategy, plan_memory and `lowmem estimate` choose the same plan."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import lightning as L
import pytest
import torch

from lightning_lowmem import LowMemoryStrategy, MemoryMonitor
from lightning_lowmem.functional.config import OptimizerConfig
from lightning_lowmem.memory import format_bytes
from lightning_lowmem.planning.estimate import estimate_memory
from lightning_lowmem.planning.plan import plan_memory
from tests.nanogpt import NanoGPT, nano_batch, nano_loader

NANO = dict(vocab_size=96, n_layer=2, n_embd=64, n_head=2, block_size=64)


def _nano(seed: int = 0) -> NanoGPT:
    torch.manual_seed(seed)
    return NanoGPT(**NANO)


def _fit(model: L.LightningModule, data, strategy: LowMemoryStrategy, kwargs: dict) -> MemoryMonitor:
    monitor = MemoryMonitor(summary=False)  # deep-measures the second step (the first with optimizer state)
    trainer = L.Trainer(strategy=strategy, max_steps=2, callbacks=[monitor], limit_val_batches=0, **kwargs)
    if isinstance(data, L.LightningDataModule):
        trainer.fit(model, datamodule=data)
    else:
        trainer.fit(model, data)
    assert monitor.last_report is not None
    return monitor


@pytest.mark.parametrize("fraction", [0.8, 0.5])
def test_nanogpt_fit_peak_stays_within_the_budget_and_equals_the_plan(tiny_trainer_kwargs, fraction):
    """A GPT with its own attention code: the plan's full estimate is what the fit measures, byte for byte.

    Before the estimate modelled Lightning's step (gradients of the previous step alive until zero_grad,
    which Lightning calls between training_step and backward), it predicted less than the fit used.
    """
    plain = estimate_memory(_nano(), nano_batch(8, 64, 96), device="cpu").peak_bytes
    budget = int(fraction * plain)
    strategy = LowMemoryStrategy(memory_budget=budget)
    monitor = _fit(
        _nano(), nano_loader(batches=2, batch_size=8, block_size=64, vocab_size=96), strategy, tiny_trainer_kwargs
    )
    plan = strategy.plan
    assert plan.config.micro_batch_size is None
    assert monitor.last_report.peak_bytes <= budget
    assert monitor.last_report.peak_bytes == plan.predicted_peak_bytes
    assert plan.chosen.per_axis_peak_bytes == plan.predicted_peak_bytes  # the per-axis prediction was exact


def test_hugging_face_gpt2_fit_peak_stays_within_the_budget(tiny_trainer_kwargs):
    hf_zoo = pytest.importorskip("tests.hf_zoo")
    plain = estimate_memory(hf_zoo.hf_module("gpt2"), hf_zoo.hf_batch("gpt2", seq_len=32, batch_size=4), device="cpu")
    budget = int(0.7 * plain.peak_bytes)
    strategy = LowMemoryStrategy(memory_budget=budget)
    monitor = _fit(
        hf_zoo.hf_module("gpt2"), hf_zoo.hf_data("gpt2", seq_len=32, batch_size=4), strategy, tiny_trainer_kwargs
    )
    assert strategy.plan.config != plain.meta["config"]
    assert monitor.last_report.peak_bytes <= budget
    assert monitor.last_report.peak_bytes == strategy.plan.predicted_peak_bytes


def test_strategy_plan_memory_and_cli_choose_the_same_plan(tiny_trainer_kwargs, caplog, tmp_path):
    """The three ways in plan the same mix. About 15 s: one fit, one plan, one `lowmem estimate` process
    (its imports alone take ~5 s), and the agreement needs all three."""
    plain = estimate_memory(_nano(), nano_batch(8, 64, 96), device="cpu").peak_bytes
    budget = int(0.6 * plain)
    direct = plan_memory(_nano(), nano_batch(8, 64, 96), budget, device="cpu")
    strategy = LowMemoryStrategy(memory_budget=budget)
    with caplog.at_level(logging.INFO):
        _fit(_nano(), nano_loader(batches=2, batch_size=8, block_size=64, vocab_size=96), strategy, tiny_trainer_kwargs)
    assert strategy.plan.config == direct.config
    assert strategy.plan.predicted_peak_bytes == direct.predicted_peak_bytes
    assert [c.config for c in strategy.plan.candidates] == [c.config for c in direct.candidates]
    assert "LowMemoryStrategy: [1/" in caplog.text  # the search, candidate by candidate
    # what the budget was read as, in bytes and GiB / MiB (issue #26 item 12: '24gb' is 22.35 GiB, said at once)
    assert f"planning memory_budget={budget:,} B = {format_bytes(budget)} on the first" in caplog.text

    config = tmp_path / "nano.yaml"
    config.write_text(
        "model:\n  class_path: tests.nanogpt.NanoGPT\n  init_args: " + json.dumps(NANO) + "\n"
        "data:\n  class_path: tests.nanogpt.NanoData\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_lowmem.cli",
            "estimate",
            "--config",
            str(config),
            "--budget",
            f"{budget}B",
            "--device",
            "cpu",
            "--real-weights",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    chosen = json.loads(out.stdout[out.stdout.index("{") :])["chosen"]
    assert chosen["label"] == direct.config.describe()
    assert chosen["predicted_peak_bytes"] == direct.predicted_peak_bytes


class _SGDNano(NanoGPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_budget_plans_with_the_configured_optimizer(tiny_trainer_kwargs):
    """configure_optimizers returns SGD: the plan keeps SGD (never an 8-bit AdamW swap), as planned."""
    torch.manual_seed(0)
    model = _SGDNano(**NANO)
    plain = estimate_memory(model, nano_batch(8, 64, 96), device="cpu", optimizer=OptimizerConfig("sgd", momentum=0.9))
    strategy = LowMemoryStrategy(memory_budget=int(0.7 * plain.peak_bytes))
    monitor = _fit(
        model, nano_loader(batches=2, batch_size=8, block_size=64, vocab_size=96), strategy, tiny_trainer_kwargs
    )
    assert {c.config.optimizer_name for c in strategy.plan.candidates} == {"sgd"}
    assert type(monitor.last_report) and isinstance(model.trainer.optimizers[0], torch.optim.SGD)


def test_the_strategy_plans_and_applies_the_chunked_loss_on_a_large_vocabulary(tiny_trainer_kwargs):
    """A Llama whose 8k-vocabulary logits are the step's peak: a budget the plain step exceeds is met with the
    chunked loss (and nothing slower), the fit measures what was planned, and the model is handed back after."""
    hf_zoo = pytest.importorskip("tests.hf_zoo")
    data = hf_zoo.hf_data("llama", seq_len=64, batch_size=4)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    model = hf_zoo.hf_module("llama", vocab_size=8192)
    plain = estimate_memory(model, batch, device="cpu").peak_bytes
    chunked = estimate_memory(model, batch, device="cpu", cross_entropy="chunked").peak_bytes
    budget = int((plain + chunked) / 2 / 0.9)
    strategy = LowMemoryStrategy(memory_budget=budget, precision="32-true")
    monitor = _fit(model, hf_zoo.hf_data("llama", seq_len=64, batch_size=4), strategy, tiny_trainer_kwargs)
    assert strategy.plan.config.cross_entropy is not None
    assert monitor.last_report.peak_bytes <= budget
    assert monitor.last_report.peak_bytes == strategy.plan.predicted_peak_bytes
    assert "forward" not in model.model.lm_head.__dict__
