"""plan_memory: generous budgets keep the plain configuration; tight ones switch techniques on."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_lowmem.demo import CharLM
from lightning_lowmem.functional.config import OptimizerConfig
from lightning_lowmem.planning.estimate import TrainingConfig, estimate_memory
from lightning_lowmem.planning.plan import DEFAULT_LR, expected_slowdown, plan_memory


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
            assert candidate.report.peak_bytes > budget  # predicted in full, or a lower bound above it
    assert "fits?" in str(plan.to_table().columns[-1].header)


def test_impossible_budget_names_the_smallest_peak(model_and_batch):
    model, batch = model_and_batch
    with pytest.raises(
        ValueError, match=r"no configuration fits `budget`='100KiB'.*smallest predicted peak is [\d.]+ (KiB|MiB)"
    ):
        plan_memory(model, batch, "100KiB", device="cpu", **AXES)


def test_budget_string_must_parse(model_and_batch):
    model, batch = model_and_batch
    with pytest.raises(ValueError, match=r"`budget`='12GB\?' is not a byte size"):
        plan_memory(model, batch, "12GB?", device="cpu")


def test_slowdown_prior_orders_techniques():
    plain = expected_slowdown(TrainingConfig())
    assert plain < expected_slowdown(TrainingConfig(micro_batch_size=4), batch_size=16)
    assert expected_slowdown(TrainingConfig(micro_batch_size=8), 16) < expected_slowdown(
        TrainingConfig(micro_batch_size=2), 16
    )


# ----------------------------------------------------------------------------- the fast planner
def test_per_axis_predictions_equal_full_estimates(model_and_batch):
    """One model-side run per setting + one optimizer profile per optimizer give every candidate's exact peak."""
    from lightning_lowmem.planning._evaluate import CandidateEvaluator

    model, batch = model_and_batch
    evaluator = CandidateEvaluator(
        model, batch, loss_fn=None, device="cpu", loop="auto", optimizer_kwargs=lambda name: {}
    )
    configs = [
        TrainingConfig(),
        TrainingConfig(optimizer="adafactor"),
        TrainingConfig(optimizer="sgd"),
        TrainingConfig(precision="bf16-mixed", activation_checkpointing="auto"),
        TrainingConfig(precision="bf16-true", activation_compression="int8"),
        TrainingConfig(micro_batch_size=4, activation_compression="bf16"),
        TrainingConfig(precision="bf16-true", lora=(("r", 4),)),
    ]
    for config in configs:
        predicted = evaluator.predict(config)
        assert predicted.meta["method"] == "per-axis"
        assert predicted.peak_bytes == estimate_memory(model, batch, device="cpu", config=config).peak_bytes, config
    assert evaluator.probes == 5  # adafactor and sgd reused the plain run
    assert evaluator.profiles == 5  # adamw on float32 weights served three model-side settings


def test_a_model_side_run_stops_once_it_passes_the_budget(model_and_batch):
    from lightning_lowmem.planning._evaluate import CandidateEvaluator

    model, batch = model_and_batch
    evaluator = CandidateEvaluator(
        model, batch, loss_fn=None, device="cpu", loop="auto", optimizer_kwargs=lambda name: {}
    )
    full = estimate_memory(model, batch, device="cpu").peak_bytes
    limit = full // 3
    bound = evaluator.predict(TrainingConfig(), limit_bytes=limit)
    assert bound.meta["method"] == "lower bound"
    assert limit < bound.peak_bytes < full  # stopped before the step's own peak
    assert evaluator.predict(TrainingConfig()).peak_bytes == full  # asked again without a limit: run in full


def test_chosen_plan_is_re_estimated_in_full_and_reports_progress(model_and_batch, caplog):
    model, batch = model_and_batch
    plain = estimate_memory(model, batch, device="cpu").peak_bytes
    seen = []
    with caplog.at_level(logging.INFO, logger="lightning_lowmem.planning.plan"):
        plan = plan_memory(
            model,
            batch,
            int(0.6 * plain),
            device="cpu",
            progress=lambda candidate, index, total: seen.append((candidate, index, total)),
        )
    assert plan.chosen.method == "full"
    assert plan.predicted_peak_bytes == estimate_memory(model, batch, device="cpu", config=plan.config).peak_bytes
    assert abs(plan.chosen.per_axis_peak_bytes / plan.predicted_peak_bytes - 1) <= 0.02
    assert [c for c, _, _ in seen][-1] is plan.chosen and all(1 <= i <= total for _, i, total in seen)
    # each configuration numbered once, in order, out of one total (it printed [1/N] twice and skipped numbers)
    assert [i for _, i, _ in seen] == list(range(1, len(seen) + 1)) and len({total for _, _, total in seen}) == 1
    assert len({c.config for c, _, _ in seen}) == len(seen)
    assert f"plan_memory [{seen[-1][1]}/{seen[-1][2]}] {plan.config.describe()}" in caplog.text
    assert any("lower bound" == c.method for c in plan.candidates)  # cheaper mixes ruled out early
    assert "estimate" in str(plan.to_table().columns[2].header)


def test_micro_batches_are_the_last_resort(model_and_batch):
    model, batch = model_and_batch
    plain = estimate_memory(model, batch, device="cpu").peak_bytes
    plan = plan_memory(model, batch, int(0.6 * plain), device="cpu")
    assert plan.config.micro_batch_size is None  # a whole-batch mix fits: no micro-batch was even tried
    assert all(c.config.micro_batch_size is None for c in plan.candidates)
    seen = []
    tight = plan_memory(
        model,
        batch,
        int(0.8 * plain),
        device="cpu",
        margin=0.0,
        **AXES_PLAIN,
        progress=lambda candidate, index, total: seen.append((candidate.config, index, total)),
    )
    assert tight.config.micro_batch_size == 8  # the whole batch does not fit: the largest micro-batch that does
    # over two stages, each configuration numbered once, in order, out of one total (the second stage restarted
    # at [1/N], and numbers of cached candidates were skipped)
    assert [i for _, i, _ in seen] == list(range(1, len(seen) + 1)) and len({total for _, _, total in seen}) == 1
    assert len({config for config, _, _ in seen}) == len(seen) and seen[-1][0] == tight.config
    assert tight.predicted_peak_bytes <= tight.usable_bytes
    assert [c.config.micro_batch_size for c in tight.candidates] == [None, 8]


AXES_PLAIN = dict(precisions=["32-true"], checkpointing=[None], compressions=[None], optimizers=["adamw"])


def test_optimizer_stays_in_its_family_unless_listed(model_and_batch):
    model, batch = model_and_batch
    plain = estimate_memory(model, batch, device="cpu").peak_bytes
    plan = plan_memory(model, batch, int(0.6 * plain), device="cpu")
    assert {c.config.optimizer_name for c in plan.candidates} <= {"adamw", "adamw8bit"}
    assert plan.optimizer_kwargs == {}
    adafactor = estimate_memory(model, batch, device="cpu", optimizer="adafactor").peak_bytes
    listed = plan_memory(
        model,
        batch,
        adafactor,
        device="cpu",
        margin=0.0,
        precisions=["32-true"],
        checkpointing=[None],
        compressions=[None],
        optimizers=["adamw", "adafactor"],
    )
    assert listed.config.optimizer_name == "adafactor"
    assert listed.optimizer_kwargs == {"lr": DEFAULT_LR["adafactor"]}  # a new family gets its own learning rate
    assert listed.optimizer == OptimizerConfig("adafactor", lr=DEFAULT_LR["adafactor"])


class _SGDLM(CharLM):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_the_configured_optimizer_is_the_baseline():
    torch.manual_seed(0)
    model = _SGDLM(n_layer=2, n_head=2, n_embd=64, block_size=32)
    x = torch.randint(0, 256, (16, 32))
    plan = plan_memory(model, (x, x.roll(-1, 1)), "4GiB", device="cpu")
    assert plan.config.optimizer_name == "sgd"
    momentum = estimate_memory(model, (x, x.roll(-1, 1)), device="cpu")  # also estimate_memory's default
    assert momentum.breakdown["optimizer_state"] == 4 * sum(p.numel() for p in model.parameters())
    assert plan.predicted_peak_bytes == momentum.peak_bytes


def test_the_sharding_axis_picks_the_least_communication_that_fits_per_gpu():
    """With world_size=2 the plan is per rank: each budget gets the first of ddp < zero1 < fsdp whose per-rank
    estimate fits, and the chosen figure is that estimate."""
    import torch.distributed as dist

    if dist.is_initialized():  # left by an in-process Lightning run: the fake ranks need their own group
        dist.destroy_process_group()
    model = CharLM(n_layer=2, n_head=2, n_embd=128, block_size=32)
    x = torch.randint(0, 256, (4, 32))
    batch = (x, x.roll(-1, 1))
    per_rank = {
        kind: estimate_memory(model, batch, device="cpu", world_size=2, sharding=kind).peak_bytes
        for kind in ("ddp", "zero1", "fsdp")
    }
    assert per_rank["fsdp"] < per_rank["zero1"] < per_rank["ddp"]
    axes = dict(
        precisions=["32-true"],
        checkpointing=[None],
        compressions=[None],
        optimizers=["adamw"],
        micro_batch_sizes=[None],
        margin=0.0,
        device="cpu",
        world_size=2,
    )
    for kind in ("ddp", "zero1", "fsdp"):
        plan = plan_memory(model, batch, per_rank[kind], **axes)
        assert (plan.config.sharding.kind, plan.config.sharding.world_size) == (kind, 2)
        assert plan.predicted_peak_bytes == per_rank[kind]
    assert plan_memory(model, batch, per_rank["ddp"], **{**axes, "shardings": ["fsdp"]}).config.sharding.kind == "fsdp"
    with pytest.raises(ValueError, match=r"no configuration fits"):
        plan_memory(model, batch, per_rank["fsdp"] - 1, **axes)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 0}, r"`world_size`=0 must be an int >= 1"),
        ({"shardings": ["fsdp"]}, r"`shardings`=\['fsdp'\] needs `world_size` > 1"),
        ({"world_size": 2, "shardings": ["fdsp"]}, r"`sharding`='fdsp' is unknown"),
        ({"world_size": 4, "config": TrainingConfig(sharding="fsdp", world_size=2)}, r"`world_size`=4 disagrees"),
    ],
)
def test_bad_sharding_axis_arguments(model_and_batch, kwargs, match):
    model, batch = model_and_batch
    with pytest.raises(ValueError, match=match):
        plan_memory(model, batch, "1GiB", device="cpu", **kwargs)


def test_the_chunked_loss_is_planned_for_a_causal_lm_whose_logits_are_the_peak():
    """A Llama with an 8k vocabulary at 4 x 64 tokens: the chunked loss alone fits a budget the plain step does
    not, and the plan is that mix with its full estimate; a model without a Hugging Face causal LM never gets it."""
    hf_zoo = pytest.importorskip("tests.hf_zoo")
    model = hf_zoo.hf_module("llama", vocab_size=8192)
    batch = hf_zoo.hf_batch("llama", seq_len=64, batch_size=4)
    plain = estimate_memory(model, batch, device="cpu")
    chunked = estimate_memory(model, batch, device="cpu", cross_entropy="chunked")
    assert chunked.peak_bytes < 0.8 * plain.peak_bytes
    budget = int((chunked.peak_bytes + plain.peak_bytes) / 2 / 0.9)  # the chunked step fits, the plain one does not
    plan = plan_memory(
        model,
        batch,
        budget,
        device="cpu",
        precisions=["32-true"],
        checkpointing=[None],
        compressions=[None],
        optimizers=["adamw"],
    )
    assert plan.config.cross_entropy is not None and plan.config.describe() == "32-true + chunked CE + adamw"
    assert plan.chosen.report.peak_bytes == chunked.peak_bytes
    assert [c.config.cross_entropy for c in plan.candidates][:2] == [None, plan.config.cross_entropy]
    charlm = plan_memory(
        CharLM(n_layer=2, n_embd=32, block_size=16), (torch.zeros(4, 16, dtype=torch.long),) * 2, "1GiB", device="cpu"
    )
    assert all(c.config.cross_entropy is None for c in charlm.candidates)


def test_a_half_precision_plan_without_master_weights_states_the_numerics_caveat():
    """bf16-true + AdamW ranks as free (1.00x) but rounds small updates away: the plan says so and names the fix."""
    from lightning_lowmem.planning.plan import numerics_caveat

    model = CharLM(n_layer=2, n_embd=64, block_size=32)
    batch = (torch.zeros(8, 32, dtype=torch.long),) * 2
    plan = plan_memory(
        model,
        batch,
        "1GiB",
        device="cpu",
        precisions=["bf16-true"],
        checkpointing=[None],
        compressions=[None],
        optimizers=["adamw"],
    )
    caveats = [note for note in plan.notes if note.startswith("numerics:")]
    assert caveats == [numerics_caveat(plan.config)] and "adamw_bf16_sr" in caveats[0]
    assert numerics_caveat(TrainingConfig(precision="bf16-true", optimizer="adafactor_in_backward")).endswith(
        "adafactor_bf16_sr (stochastic rounding, the same memory) or bf16-mixed (if it fits) keep them."
    )
    for config in (
        TrainingConfig(precision="bf16-mixed"),
        TrainingConfig(precision="bf16-true", optimizer="adamw_bf16_sr"),
    ):
        assert numerics_caveat(config) is None
