"""`lowmem demo` wall time: `--quick` (target <= 60 s) and the full demo behind `make demo` (<= 300 s).

Each is one fresh process (imports included), as a user runs it; `cpu_s` is the process's CPU time, which
on a busy machine shows how much of the wall time was waiting for a core. The per-run rows come from
the full demo's own `demo.json`. The load average at the start says whether the machine was idle: the
targets are for 2 idle cores.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"quick": 60.0, "full": 300.0}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_demo(quick: bool, out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "lightning_lowmem.cli", "demo", "--out", str(out)] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    load = os.getloadavg()[0]
    cpu, started = _cpu_seconds(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    wall, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command[2:])}` failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads((out / "demo.json").read_text())
    return {"wall_s": wall, "cpu_s": cpu, "load": load, "result": result}


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    """Time the demo; ``quick`` times only ``--quick``. The demo itself always runs on CPU."""
    rows, targets = [], []
    modes = ["quick"] if quick else ["quick", "full"]
    per_run: list[dict[str, Any]] = []
    bf16, threads = "", 1
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            measured = _run_demo(mode == "quick", Path(tmp) / mode)
            command = "lowmem demo --quick" if mode == "quick" else "lowmem demo (make demo, install excluded)"
            rows.append(
                {
                    "run": command,
                    "wall (s)": round(measured["wall_s"], 1),
                    "cpu (s)": round(measured["cpu_s"], 1),
                    "load avg at start": round(measured["load"], 2),
                }
            )
            target = TARGETS[mode]
            targets.append(
                {
                    "target": f"`{command}` <= {target:.0f} s on 2 idle cores",
                    "measured": f"{measured['wall_s']:.0f} s (load average {measured['load']:.1f} at start)",
                    "met": measured["wall_s"] <= target,
                }
            )
            settings = measured["result"]["settings"]
            threads = settings.get("threads", threads)
            bf16 = (
                "bf16 rows short (memory only): " if settings["bf16_short"] else "bf16 rows full length: "
            ) + settings["bf16_reason"]
            if mode == "full" or quick:
                per_run = [
                    {"run": f"  {run['workload']} · {run['name']}", "wall (s)": run["seconds"], "steps": run["steps"]}
                    for run in measured["result"]["runs"]
                ]
    notes = (
        f"{bf16}. Every run on {threads} torch thread{'s' if threads != 1 else ''} (`lowmem demo --threads`, "
        f"default 1). Per-run rows: the {'quick' if quick else 'full'} demo's own timing of each run (imports, corpus "
        "read, table and picture not included). A load average above ~1 means other processes shared the 2 "
        "cores and the wall times overstate an idle machine's."
    )
    if device != "cpu":
        notes += " The demo always trains on CPU; `--device` does not apply."
    return {
        "title": "lowmem demo wall time (make demo, lowmem demo --quick)",
        "rows": rows + per_run,
        "targets": targets,
        "notes": notes,
    }
