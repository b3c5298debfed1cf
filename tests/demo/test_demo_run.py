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
    assert charlm[1]["peak_bytes"] < charlm[0]["peak_bytes"]  # the stack saves memory vs the baseline
    assert (tmp_path / "memory_over_steps.png").stat().st_size > 10_000
    assert "baseline" in capsys.readouterr().out
