"""planning/search.py and planning/axes.py: the planner's steps, each on its own (plan_memory's results are
tests/planning/test_plan.py's)."""

from __future__ import annotations

import inspect

import pytest
import torch

from lightning_lowmem.demo import CharLM
from lightning_lowmem.planning.axes import AXES, axis, leanness, model_side_key
from lightning_lowmem.planning.estimate import TrainingConfig, estimate_memory
from lightning_lowmem.planning.plan import expected_slowdown, plan_memory
from lightning_lowmem.planning.search import PlanSearch


@pytest.fixture
def model_and_batch():
    torch.manual_seed(0)
    model = CharLM(n_layer=2, n_head=2, n_embd=64, block_size=32)
    x = torch.randint(0, 256, (16, 32))
    return model, (x, x.roll(-1, 1))


def test_the_axes_are_one_table_of_plan_memory_arguments_and_config_fields():
    parameters = inspect.signature(plan_memory).parameters
    fields = set(TrainingConfig.keywords())
    assert [row.argument for row in AXES] == [
        "precisions",
        "checkpointing",
        "compressions",
        "optimizers",
        "micro_batch_sizes",
        "loras",
        "cross_entropies",
        "shardings",
    ]
    for row in AXES:
        assert row.argument in parameters and row.field in fields and row.side in ("model", "optimizer", "sharding")
    assert [row.field for row in AXES if row.side == "model"] == [
        "precision",
        "checkpointing",
        "compression",
        "microbatch",
        "lora",
        "cross_entropy",
    ]
    assert axis("cross_entropy").never_adds_memory == "chunked" and axis("loras") is axis("lora")
    # every registered technique is searched by one axis, or is deliberately not a planner decision (PTQ, a
    # one-shot prune and QAT change what the model computes: the user chooses them, and `config=` carries them
    # into every candidate or refuses them in one line; a technique registered later is carried)
    from lightning_lowmem.functional.registry import techniques

    registered = {t.field for t in techniques()}
    assert {row.field for row in AXES} <= registered
    assert {"quantization", "pruning", "qat"} <= registered - {row.field for row in AXES}
    with pytest.raises(KeyError, match="no search axis 'dropout'"):
        axis("dropout")
    # candidates differing only in the optimizer share one model-side run
    assert model_side_key(TrainingConfig(optimizer="sgd")) == model_side_key(TrainingConfig(optimizer="adamw8bit"))
    qlora = TrainingConfig(
        precision="bf16-true", lora={"r": 8, "quantize_base": "int8"}, activation_checkpointing="auto"
    )
    assert leanness(qlora) > leanness(TrainingConfig(precision="bf16-true", activation_checkpointing="auto"))


def test_stages_and_their_order(model_and_batch):
    model, batch = model_and_batch
    search = PlanSearch(model, batch, "1GiB", device="cpu", axes={"compressions": [None]})
    whole, micro = search.stages
    # 3 precisions x 2 checkpointing x 1 compression x 2 optimizers, then the same x micro-batches 8, 4, 2, 1
    assert len(whole) == 12 and len(micro) == 48
    assert {c.micro_batch_size for c in micro} == {8, 4, 2, 1}
    ranked = search.ranked(whole)
    slowdowns = [expected_slowdown(c, 16) for c in ranked]
    assert slowdowns == sorted(slowdowns) and ranked[0] == TrainingConfig()
    assert ranked[-1].describe() == "bf16-true + ckpt(auto) + adamw8bit"
    fixed = PlanSearch(
        model,
        batch,
        "1GiB",
        device="cpu",
        config=TrainingConfig(precision=None, optimizer=None, activation_checkpointing="auto"),
    )
    assert all(c.activation_checkpointing == "auto" for stage in fixed.stages for c in stage)
    with pytest.raises(ValueError, match=r"unknown search axes \['dropouts'\]"):
        PlanSearch(model, batch, "1GiB", device="cpu", axes={"dropouts": [0.1]})


def test_a_prediction_equals_estimate_memory_and_the_full_estimate_confirms(model_and_batch):
    model, batch = model_and_batch
    search = PlanSearch(model, batch, "1GiB", device="cpu")
    for config in (
        TrainingConfig(),
        TrainingConfig(precision="bf16-mixed", optimizer="adamw8bit"),
        TrainingConfig(activation_checkpointing="auto", activation_compression="int8"),
    ):
        candidate = search.predict(config)
        assert candidate.method == "per-axis" and candidate.fits
        assert candidate.predicted_peak_bytes == estimate_memory(model, batch, device="cpu", config=config).peak_bytes
        assert search.confirm(candidate) and candidate.method == "full"
        assert candidate.per_axis_peak_bytes == candidate.predicted_peak_bytes
    assert search.evaluator.probes == 3 and search.evaluator.full_estimates == 3
    assert search.predict(TrainingConfig(optimizer="sgd")).method == "per-axis"
    assert search.evaluator.probes == 3  # the plain model side again, with another optimizer


def test_a_tight_budget_is_a_lower_bound_and_an_unbuildable_candidate_is_skipped(model_and_batch):
    model, batch = model_and_batch
    plain = estimate_memory(model, batch, device="cpu").peak_bytes
    search = PlanSearch(model, batch, plain // 3, device="cpu", margin=0.0)
    bound = search.predict(TrainingConfig())
    assert bound.method == "lower bound" and not bound.fits and plain // 3 < bound.predicted_peak_bytes < plain
    assert search.evaluator.model_side_over(TrainingConfig(), plain // 3)  # answered by that run: no new one
    assert search.evaluator.probes == 1
    search.skip(TrainingConfig(optimizer="sgd"), RuntimeError("no repeated block. Try another policy"))
    assert search.evaluated[TrainingConfig(optimizer="sgd")].error == "RuntimeError: no repeated block"


def test_model_side_over_runs_at_most_the_forward(model_and_batch):
    model, batch = model_and_batch
    search = PlanSearch(model, batch, "1GiB", device="cpu")
    evaluator = search.evaluator
    assert not evaluator.model_side_over(TrainingConfig(precision="bf16-true"), 2**30)  # not proven over
    assert evaluator.probes == 1 and not evaluator._probes  # a forward-only run is not kept as a model side
    assert not evaluator.model_side_over(TrainingConfig(precision="bf16-true"), 2**30) and evaluator.probes == 1
    forward_peak = estimate_memory(model, batch, device="cpu", precision="bf16-true", optimizer="sgd")
    assert evaluator.model_side_over(
        TrainingConfig(precision="bf16-true"), forward_peak.phases["forward"]["peak_bytes"] // 2
    )


def test_the_chunked_loss_twin_rules_out_a_candidate_without_a_run():
    """A candidate without the chunked loss is not run when the same candidate with it passes the budget in its
    forward: that never adds memory (checked here on every model side of the test), so it cannot fit either."""
    hf_zoo = pytest.importorskip("tests.hf_zoo")
    model = hf_zoo.hf_module("llama", vocab_size=8192)
    batch = hf_zoo.hf_batch("llama", seq_len=64, batch_size=4)
    for config in (
        TrainingConfig(),
        TrainingConfig(precision="bf16-true", activation_checkpointing="auto"),
        TrainingConfig(activation_compression="int8", optimizer="sgd"),
    ):
        with_chunked = estimate_memory(model, batch, device="cpu", config=config.replace(cross_entropy="chunked"))
        assert with_chunked.peak_bytes <= estimate_memory(model, batch, device="cpu", config=config).peak_bytes
    chunked = estimate_memory(model, batch, device="cpu", cross_entropy="chunked")
    search = PlanSearch(
        model,
        batch,
        chunked.phases["forward"]["peak_bytes"] // 2,
        device="cpu",
        margin=0.0,
        axes={"precisions": ["32-true"], "checkpointing": [None], "compressions": [None]},
    )
    assert search.axis_values["cross_entropies"] == [None, "chunked"]
    candidate = search.predict_in_order(TrainingConfig())
    assert candidate.method == "lower bound" and not candidate.fits
    assert candidate.report.meta["dominated_by"] == "32-true + chunked CE + adamw"
    assert search.evaluator.probes == 1  # the twin's forward only
    assert search.evaluated[TrainingConfig(cross_entropy="chunked")].method == "lower bound"


def test_a_model_side_whose_weights_alone_pass_the_budget_is_ruled_out_without_a_run(model_and_batch):
    model, batch = model_and_batch
    weights = sum(p.numel() for p in model.parameters())
    budget = 3 * weights  # bf16 weights (2 bytes each) fit, float32 ones (4 bytes) cannot
    search = PlanSearch(model, batch, budget, device="cpu", margin=0.0)
    fp32 = TrainingConfig(precision="bf16-mixed", optimizer="adamw")
    candidate = search.predict(fp32)
    assert search.evaluator.probes == 0  # no step was run for it
    assert candidate.fits is False and candidate.method == "lower bound"
    assert candidate.report.breakdown["parameters"] == 4 * weights
    # the bound is a lower bound: the complete estimate of the same candidate is above it
    assert estimate_memory(model, batch, device="cpu", config=fp32).peak_bytes > 4 * weights
    qlora = TrainingConfig(precision="bf16-mixed", optimizer="adamw", lora={"r": 4, "quantize_base": "int8"})
    assert search.evaluator._weight_bytes(qlora) is None  # a quantized base holds less: no bound from the weights
    search = PlanSearch(model, batch, "1GiB", device="cpu", full_check="near-budget")
    plan = search.run()
    assert plan.chosen.method == "per-axis" and search.evaluator.full_estimates == 0  # far below 98% of the budget
    with pytest.raises(ValueError, match=r"`full_check`='sometimes' is unknown"):
        PlanSearch(model, batch, "1GiB", device="cpu", full_check="sometimes")


# ----------------------------------------------------------------------------- techniques no axis searches (#35)
def test_plan_memory_keeps_qat_in_every_candidate(model_and_batch):
    """A technique of ``config=`` that no axis searches (QAT) is in every candidate and in the plan, not dropped."""
    from lightning_lowmem.functional.config import QATConfig

    model, batch = model_and_batch
    qat = QATConfig("intx4_weight_only", group_size=16)
    config = TrainingConfig.of(qat)
    search = PlanSearch(model, batch, "1GiB", device="cpu", config=config)
    assert search.carried == {"qat": qat}
    assert all(candidate.qat == qat for candidate in search.space())
    plan = plan_memory(model, batch, "1GiB", device="cpu", config=config, max_estimates=4)
    assert plan.config.qat == qat and "qat(intx4_weight_only)" in plan.config.describe()


def test_plan_memory_and_estimate_memory_refuse_pruning_in_one_line(model_and_batch):
    """Pruning's masks depend on the weights' values, which fake tensors lack: refused, in one line, before any
    estimate (it was dropped silently by plan_memory, and stopped estimate_memory with a data-dependent error)."""
    model, batch = model_and_batch
    config = TrainingConfig.of(TrainingConfig(pruning={"amount": 0.5}).pruning)
    for run in (
        lambda: plan_memory(model, batch, "1GiB", device="cpu", config=config),
        lambda: estimate_memory(model, batch, device="cpu", config=config),
    ):
        with pytest.raises(
            ValueError, match=r"cannot estimate `pruning` \(prune\(l1_unstructured 0.5\)\): .*values"
        ) as err:
            run()
        assert "\n" not in str(err.value) and "config.replace(pruning=None)" in str(err.value)
