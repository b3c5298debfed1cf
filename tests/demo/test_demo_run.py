"""`lowmem demo --quick` prints the comparison table with real numbers and writes the PNG."""

from __future__ import annotations

import json

from lightning_lowmem.cli import main


def test_demo_quick_writes_table_json_and_png(tmp_path, capsys):
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "demo.json").read_text())
    assert {run["workload"] for run in runs} == {"charlm", "digits"}
    for run in runs:
        assert run["step_ms"] > 0 and run["model_bytes"] > 0 and run["metric"] is not None
    charlm = [run for run in runs if run["workload"] == "charlm"]
    assert all(run["peak_bytes"] > 0 for run in charlm)
    baseline, bf16_true, stack = charlm
    assert bf16_true["peak_bytes"] < baseline["peak_bytes"]
    assert stack["peak_bytes"] < bf16_true["peak_bytes"] / 2  # the lowmem stack beats Lightning's bf16-true
    assert stack["breakdown"]["gradients"] < baseline["breakdown"]["gradients"] / 4  # in-backward frees grads
    digits = {run["name"].split()[0]: run for run in runs if run["workload"] == "digits"}
    base = digits["float"]["model_bytes"]
    assert digits["ScheduledPruning"]["model_bytes"] < base / 4  # 90% sparse, bitmask + values
    assert digits["PostTrainingQuantization"]["model_bytes"] < base / 3  # int8 weights
    assert digits["DistillationModule"]["model_bytes"] < base / 16  # 4x narrower student, int8
    assert (tmp_path / "memory_over_steps.png").stat().st_size > 10_000
    assert "baseline" in capsys.readouterr().out
