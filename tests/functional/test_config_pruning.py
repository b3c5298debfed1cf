"""`PruningConfig` (functional/config/pruning.py): ScheduledPruning's arguments, validated once (#27)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

from lightning_lowmem.callbacks import ScheduledPruning
from lightning_lowmem.functional import PruningConfig, prune_, sparsity

BAD = [
    (
        dict(parameter_names=[""]),
        ValueError,
        r"`parameter_names` entries must be parameter names like 'weight', got ''",
    ),
    (dict(parameter_names="weight"), TypeError, r"`parameter_names` must be a list of names like \['weight'\]"),
    (dict(amount=1.5), ValueError, r"`amount`=1.5 must be in \[0, 1\] when a float; allowed"),
    (dict(amount="half"), TypeError, r"`amount`='half' must be a float in \[0, 1\], an int >= 0 or a callable"),
    (
        dict(method="nm", n=4, m=2),
        ValueError,
        r"`n`=4, `m`=2: N:M pruning needs ints with 1 <= n < m \(e.g. n=2, m=4\)",
    ),
    (dict(verbose=3), ValueError, r"`verbose`=3 must be 0, 1 or 2"),
    (dict(structural_ratio=1.0), ValueError, r"`structural_ratio`=1.0 must be in \[0, 1\)"),
    (dict(pruning_fn="l3"), ValueError, r"`pruning_fn`='l3' is unknown; choose one of \['l1_unstructured'"),
    (dict(method="l3"), ValueError, r"`method`='l3' is unknown; choose one of \['l1_unstructured'"),
    (
        dict(pruning_fn="random_unstructured", method="nm"),
        ValueError,
        r"`method`='nm' and `pruning_fn`='random_unstructured' disagree",
    ),
    (dict(pruning_dim="0"), TypeError, r"`pruning_dim`='0' must be an int or None"),
    (dict(pruning_norm=0), ValueError, r"`pruning_norm`=0 must be a number > 0"),
    (dict(structural=1), TypeError, r"`structural` must be True or False, got int: 1"),
    (dict(apply_pruning="yes"), TypeError, r"`apply_pruning` must be True, False or a callable\(epoch\) -> bool"),
    (dict(start_step=-1), ValueError, r"`start_step`=-1 must be an int >= 0"),
    (
        dict(target_sparsity=0.5, start_step=10, end_step=5),
        ValueError,
        r"`end_step`=5 must be an int > `start_step`=10",
    ),
    (dict(schedule="cosine"), ValueError, r"`schedule`='cosine' is unknown; choose one of \['constant'"),
    (dict(target_sparsity=1.5), ValueError, r"`target_sparsity`=1.5 must be a float in \[0, 1\]"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD)
def test_config_errors_name_the_argument_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        PruningConfig(**kwargs, prune_heads=True)


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD)
def test_scheduled_pruning_raises_the_configs_message(kwargs, error, match):
    """The callback keeps its signature and has no checks of its own: the same argument, the same message."""
    with pytest.raises(error, match=match):
        ScheduledPruning(**kwargs, prune_heads=True)


def test_the_old_duplicate_checks_are_gone():
    import lightning_lowmem.functional.pruning.unstructured as unstructured

    with pytest.raises(ImportError):
        import lightning_lowmem.functional.pruning.arguments  # noqa: F401
    assert not hasattr(unstructured, "_check_amount") and not hasattr(unstructured, "_validate")


def test_config_resolves_the_method_and_the_schedule():
    assert (
        PruningConfig(method="nm", prune_heads=True).pruning_fn == "nm"
        and PruningConfig(method="nm", prune_heads=True).method is None
    )
    assert PruningConfig(torch_prune.ln_structured, prune_heads=True).pruning_fn == "ln_structured"
    assert PruningConfig("l1_unstructured", n=4, m=2, prune_heads=True).n == 4  # n/m are checked for "nm" only
    config = PruningConfig(
        target_sparsity=0.8, end_step=8, parameter_names=["weight"], parameters_to_prune=[], prune_heads=True
    )
    assert config.step_mode and config.final_sparsity == 0.8 and config.parameter_names == ("weight",)
    schedule = config.sparsity_schedule()
    assert schedule.sparsity_at(0) == 0.0 and schedule.sparsity_at(8) == pytest.approx(0.8)
    assert schedule.sparsity_at(4) == pytest.approx(0.8 * (1 - 0.5**3))  # cubic by default, not linear (0.4)
    linear = PruningConfig(schedule="linear", target_sparsity=0.8, end_step=8, prune_heads=True).sparsity_schedule()
    assert linear.sparsity_at(4) == pytest.approx(0.4)
    assert (
        PruningConfig(amount=0.5, prune_heads=True).sparsity_schedule() is None
        and not PruningConfig(prune_heads=True).step_mode
    )
    assert PruningConfig(prune_heads=True).names == ("weight", "bias") and PruningConfig(prune_heads=True).norm == 1
    assert hash(PruningConfig(parameter_names=["weight"], prune_heads=True)) == hash(
        PruningConfig(parameter_names=("weight",), prune_heads=True)
    )


def test_scheduled_pruning_builds_its_config():
    callback = ScheduledPruning(
        "l1_unstructured", schedule="cubic", target_sparsity=0.8, end_step=100, n=3, m=8, prune_heads=True
    )
    assert callback.config == PruningConfig(
        schedule="cubic", target_sparsity=0.8, end_step=100, n=3, m=8, prune_heads=True
    )
    assert (callback.method, callback.final_sparsity, callback.parameter_names) == (
        "l1_unstructured",
        0.8,
        ["weight", "bias"],
    )
    assert (
        callback.sparsity_schedule is not callback.config.sparsity_schedule()
    )  # a fresh one per call: runs own theirs


def test_prune_takes_the_config_or_its_shorthand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    report = prune_(
        model, PruningConfig(amount=0.75, parameter_names=["weight"], prune_heads=True)
    )  # global (the config's default)
    assert report.sparsity == 0.75 and report.num_prunable == 96 and sparsity(model) == 0.75
    assert set(report.per_tensor.values()) != {0.75}  # ranked across both layers (global), not 75% of each
    nm = nn.Linear(8, 4)
    assert (
        prune_(nm, PruningConfig(method="nm", n=1, m=4, parameter_names=["weight"], prune_heads=True)).sparsity == 0.75
    )
    assert all(int(row.count_nonzero()) == 1 for row in nm.weight.detach().reshape(-1, 4))
    with pytest.raises(ValueError, match=r"`global_`, `norm` given beside a PruningConfig; set them in the config"):
        prune_(model, PruningConfig(prune_heads=True), global_=True, norm=2)
    with pytest.raises(TypeError, match=r"`amount`=<function .*> must be a float in \[0, 1\] or an int >= 0 here"):
        prune_(model, PruningConfig(amount=lambda epoch: 0.1, prune_heads=True))
    with pytest.raises(ValueError, match=r"`n`=4, `m`=4: N:M pruning needs ints with 1 <= n < m"):
        prune_(model, 0.5, "nm", n=4, m=4, heads=True)  # the shorthand's errors are the config's


def test_prune_config_names_parameters_as_strings():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    report = prune_(model, PruningConfig(amount=0.5, parameters_to_prune=["2.weight"], prune_heads=True))
    assert list(report.per_tensor) == ["2.weight"] and report.sparsity == 0.5
    assert float((model[0].weight == 0).float().mean()) == 0.0
