"""Run benchmarks and write ``benchmarks/results/<name>.json`` + ``.md`` and a combined README.md.

Each ``benchmarks/bench_<name>.py`` defines ``run(device: str = "cpu", quick: bool = False) -> dict`` with
keys ``title`` (str), ``rows`` (list of flat dicts, one per configuration; the first row is the
anchor/baseline where there is one), and optionally ``targets`` (list of {"target": str, "measured": str,
"met": bool}) and ``notes`` (str).

Usage::

    python -m benchmarks                  # everything, CPU
    python -m benchmarks --only memory    # one module (bench_memory.py)
    python -m benchmarks --device cuda    # on a GPU
    python -m benchmarks --quick          # smaller settings (what the GPU check runs on CUDA)
    python -m benchmarks --smoke --out /tmp/x   # tiny settings: the code paths run, numbers meaningless (<name>_smoke.*)

Results of ``--device cuda`` are written as ``<name>_cuda.json`` / ``.md``; beside each CUDA target the
Markdown shows its CPU twin, read from the CPU results (``<name>.json`` in ``benchmarks/results/``): the
target of the same text, or the one a CUDA target names in its ``twin`` key.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def discover() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _measured_line(env: dict[str, str]) -> str:
    device = env.get("device", "")
    if env.get("driver"):
        device += f" (driver {env['driver']}, CUDA {env.get('cuda', '?')})"
    return (
        f"_Measured {env.get('date', '')} on {device}, torch {env.get('torch', '')}, "
        f"lightning {env.get('lightning', '')}; command: `{env.get('command', '')}`_"
    )


def to_markdown(result: dict[str, Any]) -> str:
    lines = [f"## {result['title']}", ""]
    env = result.get("environment", {})
    if env:
        lines += [_measured_line(env), ""]
    rows = result.get("rows", [])
    if rows:
        columns: list[str] = []
        for row in rows:
            columns += [c for c in row if c not in columns]
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "---|" * len(columns))
        for row in rows:
            lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
        lines.append("")
    targets = result.get("targets", [])
    twins = result.get("cpu_twin")
    if targets and twins is not None:
        lines += ["| target | measured | met | CPU twin: measured (met) |", "|---|---|---|---|"]
        for t in targets:
            twin = twins["targets"].get(t.get("twin", t["target"]))
            cpu = f"{twin['measured']} ({'yes' if twin['met'] else 'no'})" if twin else "-"
            lines.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} | {cpu} |")
        lines += ["", f"CPU twin: `{twins['file']}`, measured {twins['date']} on {twins['device']}.", ""]
    elif targets:
        lines += ["| target | measured | met |", "|---|---|---|"]
        for t in targets:
            lines.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} |")
        lines.append("")
    if result.get("notes"):
        lines += [result["notes"], ""]
    return "\n".join(lines)


def _nvidia_driver() -> str:
    """The NVIDIA driver version (``nvidia-smi``), or ``"unknown"``."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return out.strip().splitlines()[0] or "unknown"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001 - missing or broken: say so, the run goes on
        return "not installed"


def environment(device: str, argv: list[str]) -> dict[str, str]:
    import lightning
    import torch

    env = {
        "date": time.strftime("%Y-%m-%d"),
        "device": f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "torchao": _version("torchao"),
        "python": platform.python_version(),
        "command": "python -m benchmarks " + " ".join(argv),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            device=torch.cuda.get_device_name(),
            gpu_memory_gib=f"{props.total_memory / 2**30:.1f}",
            compute_capability=f"{props.major}.{props.minor}",
            driver=_nvidia_driver(),
            cuda=str(torch.version.cuda),
        )
    return env


def cpu_twin(name: str) -> dict[str, Any] | None:
    """The CPU results of benchmark ``name`` (``benchmarks/results/<name>.json``), for CUDA tables."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return None
    cpu = json.loads(path.read_text())
    env = cpu.get("environment", {})
    return {
        "file": f"benchmarks/results/{path.name}",
        "date": env.get("date", "?"),
        "device": env.get("device", "CPU"),
        "targets": {t["target"]: {"measured": t["measured"], "met": t["met"]} for t in cpu.get("targets", [])},
    }


def write_combined(out_dir: Path) -> Path:
    parts = [
        "# Benchmark results",
        "",
        "Written by `python -m benchmarks` (see `benchmarks/__main__.py`). Do not edit by hand.",
        "",
    ]
    for path in sorted(out_dir.glob("*.json")):
        parts.append(to_markdown(json.loads(path.read_text())))
    combined = out_dir / "README.md"
    combined.write_text("\n".join(parts))
    return combined


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help=f"benchmarks to run, from {discover()}")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="smaller settings (what the GPU check runs)")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny settings: checks the code paths run (implies --quick)"
    )
    parser.add_argument("--out", default=str(RESULTS), help="output folder")
    args = parser.parse_args(argv)
    names = args.only or discover()
    unknown = sorted(set(names) - set(discover()))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {discover()}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.smoke and Path(args.out).resolve() == RESULTS.resolve():
        parser.error(f"--smoke numbers are meaningless: give --out a scratch folder, not {RESULTS}")
    if args.smoke:
        from benchmarks.common import SMOKE_ENV

        os.environ[SMOKE_ENV] = "1"  # benchmarks.common.smoke(); inherited by the benchmarks' subprocesses
        # one intra-op thread: tiny models gain nothing from two, and on a loaded machine two threads wait on
        # each other (the smoke run took 5x longer with two on a shared 2-core machine)
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # a smoke run writes what a CUDA run writes (CPU twin column included), named <name>_smoke: the dry run of
    # scripts/gpu_check.py checks the GPU run's output path without a file that could pass for a CUDA result
    suffix = "_smoke" if args.smoke else "" if args.device == "cpu" else f"_{args.device}"
    for name in names:
        module = importlib.import_module(f"benchmarks.bench_{name}")
        started = time.perf_counter()
        print(f"[benchmarks] {name} ...", flush=True)
        result = module.run(device=args.device, quick=args.quick or args.smoke)
        result["environment"] = environment(args.device, argv)
        result["seconds"] = round(time.perf_counter() - started, 1)
        if args.smoke:
            result["title"] += " [smoke run: tiny settings, numbers meaningless]"
        if args.device == "cuda" or args.smoke:
            result["cpu_twin"] = cpu_twin(name) or {"file": "none", "date": "-", "device": "-", "targets": {}}
        (out_dir / f"{name}{suffix}.json").write_text(json.dumps(result, indent=2, default=str))
        (out_dir / f"{name}{suffix}.md").write_text(to_markdown(result))
        print(to_markdown(result), flush=True)
    combined = write_combined(out_dir)
    print(f"[benchmarks] wrote {combined}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
