"""`MemoryMonitor`'s counting and formatting in `memory/monitoring.py` (no Lightning)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.memory.monitoring import (
    cheap_figures,
    check_intervals,
    is_deep_step,
    report_figures,
    summary_table,
    with_all_ranks,
)
from lightning_lowmem.memory.report import CATEGORIES, MemoryReport


def test_check_intervals_names_the_argument():
    check_intervals(3, 0)
    with pytest.raises(ValueError, match=r"`log_every_n_steps` must be a positive int .* got 1.5"):
        check_intervals(1.5, None)
    with pytest.raises(ValueError, match=r"`deep_every_n_steps` must be an int >= 0 .* got -1"):
        check_intervals(None, -1)


def test_is_deep_step_second_step_then_every_n():
    assert [step for step in range(10) if is_deep_step(step, None)] == [1]
    assert [step for step in range(10) if is_deep_step(step, 4)] == [1, 4, 8]
    assert not any(is_deep_step(step, 0) for step in range(10))


def test_report_figures_peak_and_every_category():
    breakdown = {category: index for index, category in enumerate(CATEGORIES)}
    figures = report_figures(MemoryReport(peak_bytes=sum(breakdown.values()), breakdown=breakdown))
    assert figures == {"peak": 10, **breakdown}


def test_cheap_figures_on_cpu_count_model_and_optimizer_state():
    model = nn.Linear(100, 10)  # 1010 float32 parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 100)).sum().backward()
    optimizer.step()  # momentum buffers: as many again
    figures = cheap_figures("cpu", model, [optimizer])
    assert figures["model_state"] == 3 * 1010 * 4  # parameters + gradients + momentum
    assert figures["rss"] > 1 << 20


def test_with_all_ranks_max_and_per_rank_headline_figures():
    gathered = torch.tensor([[10.0, 300.0], [30.0, 100.0]], dtype=torch.float64)  # keys sorted: other, peak
    combined = with_all_ranks({"peak": 300, "other": 10}, lambda mine: gathered, world_size=2)
    assert combined["peak_max"] == 300.0 and combined["other_max"] == 30.0
    assert combined["rank0/peak"] == 300.0 and combined["rank1/peak"] == 100.0
    assert "rank1/other" not in combined  # only the headline figures per rank
    assert with_all_ranks({}, lambda mine: 1 / 0, world_size=2) == {}  # nothing to gather: no collective


def test_summary_table_rows():
    assert summary_table([], None, "cpu") is None
    history = [{"rss": 1024, "peak_max": 4096}, {"rss": 3072, "model_state": 2048}]
    breakdown = dict.fromkeys(CATEGORIES, 0)
    table = summary_table(history, MemoryReport(peak_bytes=0, breakdown=breakdown), "cuda")
    rows = list(zip(table.columns[0].cells, table.columns[1].cells, strict=True))
    assert ("max rss (per-step)", "3.00 KiB") in rows
    assert ("max model_state (per-step)", "2.00 KiB") in rows
    assert ("max peak over ranks", "4.00 KiB") in rows
    assert table.title == "Training step memory (cuda)"
