"""Sparsity schedules: exact formulas, frequency holding, bad input."""

from __future__ import annotations

import pytest

from lightning_lowmem.schedules import SparsitySchedule, build_schedule


def test_cubic_matches_zhu_gupta_formula_at_every_step():
    s_i, s_f, t0, end = 0.1, 0.9, 5, 25
    schedule = SparsitySchedule("cubic", final_sparsity=s_f, start_step=t0, end_step=end, initial_sparsity=s_i)
    for t in range(t0, end + 10):
        expected = s_f + (s_i - s_f) * (1 - (min(t, end) - t0) / (end - t0)) ** 3
        assert schedule(t) == pytest.approx(expected, abs=1e-12)
    assert schedule(end) == s_f
    assert schedule(t0 - 1) == 0.0


def test_frequency_holds_value_between_pruning_steps():
    schedule = SparsitySchedule("linear", final_sparsity=0.8, start_step=0, end_step=10, frequency=4)
    assert [schedule(t) for t in (0, 3, 4, 7, 8, 9, 10)] == pytest.approx([0.0, 0.0, 0.32, 0.32, 0.64, 0.64, 0.8])
    assert [t for t in range(12) if schedule.is_pruning_step(t)] == [0, 4, 8, 10]


@pytest.mark.parametrize("kind", ["constant", "linear", "cubic", "exponential"])
def test_every_kind_is_monotone_and_reaches_target(kind):
    schedule = build_schedule(kind, 0.9, 0, 50)
    values = [schedule(t) for t in range(60)]
    assert all(b >= a - 1e-12 for a, b in zip(values, values[1:], strict=False))
    assert values[-1] == pytest.approx(0.9)


def test_callable_schedule_is_used_as_given():
    fn = lambda step: 0.01 * step  # noqa: E731
    assert build_schedule(fn) is fn


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kind="cosine"), r"`schedule`='cosine' is unknown; choose one of \['constant'"),
        (dict(final_sparsity=1.5), r"`target_sparsity`=1.5 must be a float in \[0, 1\]"),
        (dict(start_step=10, end_step=10), r"`end_step`=10 must be an int > `start_step`=10"),
        (dict(frequency=0), r"`frequency`=0 must be an int >= 1"),
        (dict(start_step=-1), r"`start_step`=-1 must be an int >= 0"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparsitySchedule(**kwargs)


def test_build_schedule_rejects_non_callable():
    with pytest.raises(TypeError, match="`schedule` must be one of"):
        build_schedule(3)
