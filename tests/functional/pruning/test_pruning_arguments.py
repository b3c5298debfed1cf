"""`ScheduledPruning`'s argument checks in `functional/pruning/arguments.py`."""

from __future__ import annotations

import pytest
from torch.nn.utils import prune as torch_prune

from lightning_lowmem.functional.pruning.arguments import check_pruning_arguments, resolve_method, step_schedule


def test_resolve_method_alias_and_torch_function():
    assert resolve_method("l1_unstructured", method="nm") == "nm"
    assert resolve_method(torch_prune.ln_structured) == "ln_structured"
    with pytest.raises(ValueError, match=r"`method`='nm' and `pruning_fn`='random_unstructured' disagree"):
        resolve_method("random_unstructured", method="nm")
    with pytest.raises(ValueError, match=r"`pruning_fn`='l3' is unknown"):
        resolve_method("l3")


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("l1_unstructured", [""], 0.5), {}, ValueError, r"`parameter_names` entries must be parameter names like 'weight', got ''"),
        (("l1_unstructured", ["weight"], 1.5), {}, ValueError, r"`amount`=1.5 must be in \[0, 1\]"),
        (("l1_unstructured", ["weight"], "half"), {}, TypeError, r"`amount`='half' must be a float"),
        (("nm", ["weight"], 0.5), {"n": 4, "m": 2}, ValueError, r"`n`=4, `m`=2: N:M pruning needs ints"),
        (("l1_unstructured", ["weight"], 0.5), {"verbose": 3}, ValueError, r"`verbose`=3 must be 0, 1 or 2"),
        (("l1_unstructured", ["weight"], 0.5), {"structural_ratio": 1.0}, ValueError, r"`structural_ratio`=1.0 must be in \[0, 1\)"),
    ],
)
def test_check_pruning_arguments_rejects(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        check_pruning_arguments(*args, **kwargs)


def test_check_pruning_arguments_nm_bounds_apply_to_nm_only():
    assert check_pruning_arguments("l1_unstructured", ["weight"], 3, n=4, m=2) is None
    assert check_pruning_arguments("nm", ["weight", "bias"], 0.5, n=1, m=2, verbose=2, structural_ratio=0.0) is None


def test_step_schedule_cubic_by_default_and_none_in_epoch_mode():
    schedule = step_schedule(None, 0.8, start_step=0, end_step=8, step_mode=True)
    assert schedule.sparsity_at(0) == 0.0 and schedule.sparsity_at(8) == pytest.approx(0.8)
    assert schedule.sparsity_at(4) == pytest.approx(0.8 * (1 - 0.5**3))  # cubic, not linear (0.4)
    assert step_schedule("linear", 0.8, end_step=8, step_mode=True).sparsity_at(4) == pytest.approx(0.4)
    assert step_schedule(None, 0.5, step_mode=False) is None
    with pytest.raises(ValueError, match=r"`start_step`=-1 must be an int >= 0"):
        step_schedule(None, 0.5, start_step=-1, step_mode=False)
