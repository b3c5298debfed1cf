"""Gradient accumulation in the estimate (issue #33 item 3): ``accumulate_grad_batches=N`` runs N forwards and
backwards per optimizer step, the gradients of the first backward alive through the later ones."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_lowmem.memory import measure_memory
from lightning_lowmem.planning.estimate import TrainingConfig, estimate_memory


def _nanogpt():
    from tests.nanogpt import NanoGPT

    torch.manual_seed(0)
    return NanoGPT(vocab_size=64, n_layer=2, n_embd=64, n_head=2, block_size=32)


@pytest.mark.parametrize(("precision", "optimizer"), [("32-true", "adamw"), ("bf16-true", "adafactor")])
def test_estimate_equals_the_peak_of_a_fit_with_accumulate_grad_batches(tmp_path, precision, optimizer):
    """Lightning with accumulate_grad_batches=4: the later batches' forward and backward run beside the gradients
    of the earlier ones (backward adds into them through a temporary). The estimate equals the fit's peak."""
    import lightning as L

    from lightning_lowmem import LowMemoryStrategy, MemoryMonitor
    from tests.nanogpt import nano_loader

    model = _nanogpt()
    loader = nano_loader(batches=12, batch_size=4, block_size=32, vocab_size=64)
    batch = next(iter(loader))
    kwargs = dict(device="cpu", precision=precision, optimizer=optimizer)
    estimate = estimate_memory(model, batch, accumulate_grad_batches=4, **kwargs)
    single = estimate_memory(model, batch, **kwargs)
    monitor = MemoryMonitor(summary=False)  # measures the step's last batch: the peak of the window (its forward
    trainer = L.Trainer(  # and backward beside the accumulated gradients, then the optimizer step)
        strategy=LowMemoryStrategy(precision=precision, optimizer=optimizer),
        max_steps=3,
        accumulate_grad_batches=4,
        callbacks=[monitor],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, loader)
    measured = monitor.last_report
    assert estimate.peak_bytes == measured.peak_bytes
    assert estimate.peak_bytes > single.peak_bytes  # one micro-batch was estimated before: low
    for category in ("parameters", "gradients", "optimizer_state"):
        assert estimate.breakdown[category] == measured.breakdown[category]
    assert estimate.other_breakdown["backward temporaries"] == measured.other_breakdown["backward temporaries"]
    assert estimate.meta["accumulate_grad_batches"] == 4


def test_torch_loop_estimate_equals_the_measured_accumulating_step():
    """torch's order (forward, backward ... step, zero_grad) over 3 batches on real tensors, measured."""
    from lightning_lowmem.functional.optimizers.catalog import build_optimizer
    from lightning_lowmem.planning.estimate import _train_step, default_loss
    from tests.nanogpt import nano_loader

    batch = next(iter(nano_loader(batches=1, batch_size=4, block_size=32, vocab_size=64)))
    estimate = estimate_memory(
        _nanogpt(), batch, device="cpu", optimizer="adamw", loss_fn=default_loss, accumulate_grad_batches=3
    )
    model = _nanogpt()
    config = TrainingConfig(optimizer="adamw")
    optimizer = build_optimizer("adamw", list(model.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train_step(model, batch, default_loss, optimizer, config, None, loop="torch", accumulate=3)
        measured = measure_memory(
            _train_step, model, batch, default_loss, optimizer, config, None, loop="torch", accumulate=3, module=model
        )
    assert estimate.peak_bytes == measured.peak_bytes
    assert estimate.breakdown["gradients"] == measured.breakdown["gradients"] > 0  # alive in the later backward


def test_accumulation_with_micro_batches_is_the_larger_batch_in_micro_batches():
    """4 batches of 8 in micro-batches of 4 step like one batch of 32 in micro-batches of 4 (AutoMicrobatch)."""
    from tests.nanogpt import nano_loader

    small = next(iter(nano_loader(batches=1, batch_size=8, block_size=32, vocab_size=64)))
    large = next(iter(nano_loader(batches=1, batch_size=32, block_size=32, vocab_size=64)))
    kwargs = dict(device="cpu", optimizer="adamw", micro_batch_size=4, loop="torch")
    accumulated = estimate_memory(_nanogpt(), small, accumulate_grad_batches=4, **kwargs)
    whole = estimate_memory(_nanogpt(), large, **kwargs)
    assert accumulated.peak_bytes == whole.peak_bytes - (large[0].nbytes + large[1].nbytes - 2 * small[0].nbytes)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "4"])
def test_bad_accumulate_grad_batches_is_refused(value):
    batch = (torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long))
    with pytest.raises(ValueError, match=r"`accumulate_grad_batches`=.* must be an int >= 1"):
        estimate_memory(_nanogpt(), batch, device="cpu", accumulate_grad_batches=value)


def test_accumulation_with_an_optimizer_in_backward_is_refused():
    batch = (torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long))
    with pytest.raises(ValueError, match=r"`accumulate_grad_batches`=4 cannot be estimated with optimizer 'adamw_in"):
        estimate_memory(_nanogpt(), batch, device="cpu", optimizer="adamw_in_backward", accumulate_grad_batches=4)


def test_plan_memory_and_the_strategy_budget_plan_the_accumulated_step(tmp_path):
    """plan_memory(accumulate_grad_batches=4) predicts the accumulating step; LowMemoryStrategy(memory_budget=)
    reads the Trainer's accumulate_grad_batches, so its plan says the same."""
    import lightning as L

    from lightning_lowmem import LowMemoryStrategy
    from lightning_lowmem.planning.plan import plan_memory
    from tests.nanogpt import nano_loader

    loader = nano_loader(batches=8, batch_size=4, block_size=32, vocab_size=64)
    batch = next(iter(loader))
    kwargs = dict(device="cpu", optimizer="adamw", precisions=["32-true"], checkpointing=[None], compressions=[None])
    single = plan_memory(_nanogpt(), batch, "1GiB", **kwargs)
    accumulated = plan_memory(_nanogpt(), batch, "1GiB", accumulate_grad_batches=4, **kwargs)
    estimate = estimate_memory(_nanogpt(), batch, device="cpu", optimizer="adamw", accumulate_grad_batches=4)
    assert accumulated.predicted_peak_bytes == estimate.peak_bytes > single.predicted_peak_bytes

    strategy = LowMemoryStrategy(memory_budget="1GiB", optimizer="adamw", precision="32-true")
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=1,
        accumulate_grad_batches=4,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_nanogpt(), loader)
    assert strategy.plan.chosen.report.meta["accumulate_grad_batches"] == 4
    with pytest.raises(ValueError, match="`budget` is missing"):
        plan_memory(_nanogpt(), batch, device="cpu")
