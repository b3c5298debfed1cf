"""plan_memory on models users bring beyond HF text: a candidate that cannot be built on the model (checkpointing
"auto" with no repeated block) is skipped and listed, never a reason to answer "nothing fits"."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from lightning_lowmem.planning.estimate import TrainingConfig, estimate_memory
from lightning_lowmem.planning.plan import plan_memory
from tests.vision_zoo import hf_resnet, image_batch, sequential_cnn

AUTO_MATCHES_NOTHING = "activation checkpointing policy 'auto' matched no submodule of Sequential"


def _peak(model, batch, precision):
    return estimate_memory(
        model, batch, device="cpu", config=TrainingConfig(precision=precision, optimizer="adamw")
    ).peak_bytes


def test_a_candidate_that_cannot_be_built_is_skipped_and_listed_not_fatal():
    model, batch = sequential_cnn(), image_batch()
    bf16_true, bf16_mixed = _peak(model, batch, "bf16-true"), _peak(model, batch, "bf16-mixed")
    assert bf16_true < bf16_mixed
    budget = (bf16_true + bf16_mixed) // 2  # only bf16-true (of the whole-batch, no-checkpointing mixes) fits
    plan = plan_memory(model, batch, budget, device="cpu", margin=0.0, micro_batch_sizes=[None])
    assert plan.config.precision_preset == "bf16-true" and plan.config.micro_batch_size is None
    assert plan.predicted_peak_bytes == bf16_true <= budget
    # the leanest candidates (checkpointing "auto") could not be built: listed with why, in the plan and its notes
    (reason,) = plan.skipped
    assert AUTO_MATCHES_NOTHING in reason
    assert all("ckpt(auto)" in label for label in plan.skipped[reason])
    assert any(AUTO_MATCHES_NOTHING in note for note in plan.notes)
    assert plan.to_dict()["skipped"] == plan.skipped
    console = Console(file=io.StringIO(), width=200)
    console.print(plan.to_table())  # what `lowmem estimate --budget` prints
    assert f"skipped {len(plan.skipped[reason])} that cannot be built: {reason}" in console.file.getvalue()
    skipped_rows = [c for c in plan.candidates if c.error]
    assert skipped_rows and all(c.fits is False and c.report is None for c in skipped_rows)


def test_nothing_fits_names_what_was_skipped_and_why():
    model, batch = sequential_cnn(), image_batch()
    with pytest.raises(
        ValueError,
        match=r"no configuration fits .*Skipped \(cannot be built on this model\): \d+ x "
        r"ValueError: activation checkpointing policy 'auto' matched no submodule of Sequential",
    ):
        plan_memory(model, batch, 100_000, device="cpu", margin=0.0, micro_batch_sizes=[None])


def test_hf_resnet_with_one_stage_plans_bf16_true_where_only_it_fits():
    # one stage: no nn.ModuleList holds two blocks of a class; the planner used to skip every stage and say no
    model, batch = hf_resnet(hidden_sizes=(16,), depths=(1,)), image_batch()
    bf16_true, bf16_mixed = _peak(model, batch, "bf16-true"), _peak(model, batch, "bf16-mixed")
    budget = (bf16_true + bf16_mixed) // 2
    plan = plan_memory(model, batch, budget, device="cpu", margin=0.0, micro_batch_sizes=[None])
    assert plan.config.precision_preset == "bf16-true"
    assert plan.predicted_peak_bytes <= budget
