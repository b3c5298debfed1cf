"""The pieces ``ScheduledPruning`` delegates to: the step schedule, target resolution, rewind, shrink-on-load."""

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.pruning.masks import get_mask
from lightning_lowmem.functional.pruning.schedule import PruningSchedule, check_amount, method_name
from lightning_lowmem.functional.pruning.structural import example_row, shrink_to_state_dict_
from lightning_lowmem.functional.pruning.targets import resolve_targets, rewind_, snapshot
from lightning_lowmem.functional.pruning.unstructured import prune_


def test_schedule_prunes_on_the_frequency_grid_and_the_last_step_with_cubic_values():
    schedule = PruningSchedule("cubic", 0.8, start_step=2, end_step=11, frequency=3)
    assert [step for step in range(15) if schedule.is_pruning_step(step)] == [2, 5, 8, 11]
    # Zhu & Gupta: s_f + (s_i - s_f) * (1 - progress) ** 3, progress = (t - 2) / 9
    assert schedule.sparsity_at(2) == 0.0
    assert schedule.sparsity_at(5) == pytest.approx(0.8 - 0.8 * (1 - 3 / 9) ** 3)
    assert schedule.sparsity_at(8) == pytest.approx(0.8 - 0.8 * (1 - 6 / 9) ** 3)
    assert schedule.sparsity_at(11) == 0.8


def test_schedule_end_step_none_resolves_to_the_last_step():
    schedule = PruningSchedule("linear", 0.5, start_step=0)
    assert schedule.end_step is None and schedule.function is None
    schedule.resolve_last_step(10)
    assert schedule.end_step == 10 and schedule.sparsity_at(5) == pytest.approx(0.25)
    with pytest.raises(
        ValueError, match=r"`end_step`=None resolves to the run's last step 3, which is not > `start_step`"
    ):
        PruningSchedule("linear", 0.5, start_step=3).resolve_last_step(3)


def test_schedule_and_argument_errors_name_the_value():
    with pytest.raises(ValueError, match=r"`schedule`='quadratic' is unknown"):
        PruningSchedule("quadratic", 0.5)
    with pytest.raises(ValueError, match=r"`target_sparsity`=1.5 must be a float in \[0, 1\]"):
        PruningSchedule("cubic", 1.5)
    with pytest.raises(ValueError, match=r"`schedule`\(4\) returned 2.0; a sparsity must be in \[0, 1\]"):
        PruningSchedule(lambda step: 2.0, 0.5, end_step=10).sparsity_at(4)
    with pytest.raises(ValueError, match=r"`amount`=-1 must be >= 0"):
        check_amount(-1)
    with pytest.raises(TypeError, match=r"`pruning_fn`=42 must be one of"):
        method_name(42)
    assert method_name(torch.nn.utils.prune.random_unstructured) == "random_unstructured"


def test_resolve_targets_finds_strings_and_skips_embeddings_unless_asked():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 2, bias=False))
    assert [(f, p) for f, _, p in resolve_targets(model, ["2.weight"], heads=True)] == [("2", "weight")]
    default = [(f, p) for f, _, p in resolve_targets(model, names_given=False, heads=True)]
    assert default == [("1", "weight"), ("1", "bias"), ("2", "weight")]
    assert ("0", "weight") in [
        (f, p) for f, _, p in resolve_targets(model, names_given=False, embeddings=True, heads=True)
    ]
    with pytest.raises(ValueError, match=r"`parameters_to_prune` entry '3.weight' names no submodule of Sequential"):
        resolve_targets(model, ["3.weight"], heads=True)
    with pytest.raises(ValueError, match=r"`parameter_names` contains \['scale'\], which no module has"):
        resolve_targets(model, parameter_names=["weight", "scale"], heads=True)


def test_rewind_restores_the_snapshot_and_keeps_pruned_entries_zero():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    targets = resolve_targets(model, parameter_names=["weight"], heads=True)
    saved = snapshot(targets)
    prune_(model, 0.5, "l1_unstructured", parameters_to_prune=[(sub, p) for _, sub, p in targets], heads=True)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    rewind_(targets, saved)
    mask = get_mask(model[0], "weight")
    assert int((~mask).sum()) == 32  # half of the 64 weights pruned
    assert torch.equal(model[0].weight, saved["0.weight"] * mask)


def test_shrink_to_state_dict_resizes_only_a_shrink():
    small = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    changed = shrink_to_state_dict_(fresh, {f"model.{k}": v for k, v in small.state_dict().items()}, "model.")
    assert changed == {"0.weight": [4, 8], "0.bias": [4], "2.weight": [2, 4]}
    fresh.load_state_dict(small.state_dict())
    assert fresh[0].out_features == 4
    bigger = nn.Sequential(nn.Linear(8, 32))
    assert shrink_to_state_dict_(nn.Sequential(nn.Linear(8, 16)), bigger.state_dict()) == {}  # not a shrink


def test_example_row_takes_one_row_of_tuple_and_dict_batches():
    x = torch.arange(12).view(4, 3)
    assert torch.equal(example_row((x, torch.zeros(4))), x[:1])
    row = example_row({"input_ids": x, "labels": x, "meta": "text"})
    assert set(row) == {"input_ids", "labels"} and row["input_ids"].shape == (1, 3)
