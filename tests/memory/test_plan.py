"""plan_memory: generous budgets keep the plain configuration; tight ones switch techniques on."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem.demo import CharLM
from lightning_lowmem.memory.estimate import TrainingConfig, estimate_memory
from lightning_lowmem.memory.plan import expected_slowdown, plan_memory


@pytest.fixture
def model_and_batch():
    torch.manual_seed(0)
    model = CharLM(n_layer=2, n_head=2, n_embd=64, block_size=32)
    x = torch.randint(0, 256, (16, 32))
    return model, (x, x.roll(-1, 1))


AXES = dict(checkpointing=[None], compressions=[None], optimizers=["adamw", "sgd"])


def test_generous_budget_returns_the_plain_configuration(model_and_batch):
    model, batch = model_and_batch
    plan = plan_memory(model, batch, "4GiB", device="cpu", **AXES)
    assert plan.config == TrainingConfig()
    assert plan.candidates[0] is plan.chosen


def test_tight_budget_picks_a_fitting_mix_below_the_plain_peak(model_and_batch):
    model, batch = model_and_batch
    plain = estimate_memory(model, batch, device="cpu").peak_bytes
    budget = int(plain * 0.8)
    plan = plan_memory(model, batch, budget, device="cpu", margin=0.0, **AXES)
    assert plan.config != TrainingConfig()
    assert plan.predicted_peak_bytes <= budget
    # nothing cheaper (by prior slowdown) that was tried fits
    for candidate in plan.candidates:
        if candidate.slowdown < plan.chosen.slowdown and candidate.report is not None:
            assert candidate.report.peak_bytes > budget
    assert "fits?" in str(plan.to_table().columns[-1].header)


def test_impossible_budget_names_the_smallest_peak(model_and_batch):
    model, batch = model_and_batch
    with pytest.raises(ValueError, match=r"no configuration fits `budget`='100KiB'.*smallest predicted peak is [\d.]+ (KiB|MiB)"):
        plan_memory(model, batch, "100KiB", device="cpu", **AXES)


def test_budget_string_must_parse(model_and_batch):
    model, batch = model_and_batch
    with pytest.raises(ValueError, match=r"`budget`='12GB\?' is not a byte size"):
        plan_memory(model, batch, "12GB?", device="cpu")


def test_slowdown_prior_orders_techniques():
    plain = expected_slowdown(TrainingConfig())
    assert plain < expected_slowdown(TrainingConfig(micro_batch_size=4), batch_size=16)
    assert expected_slowdown(TrainingConfig(micro_batch_size=8), 16) < expected_slowdown(TrainingConfig(micro_batch_size=2), 16)
