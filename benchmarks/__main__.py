"""Run benchmarks and write ``benchmarks/results/<name>.json`` + ``.md`` and a combined README.md.

Each ``benchmarks/bench_<name>.py`` defines ``run(device: str = "cpu", quick: bool = False) -> dict`` with
keys ``title`` (str), ``rows`` (list of flat dicts, one per configuration; the first row is the
anchor/baseline where there is one), and optionally ``targets`` (list of {"target": str, "measured": str,
"met": bool}) and ``notes`` (str).

Usage::

    python -m benchmarks                  # everything, CPU
    python -m benchmarks --only memory    # one module (bench_memory.py)
    python -m benchmarks --device cuda    # on a GPU
    python -m benchmarks --quick          # smaller settings, for a smoke run
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
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


def to_markdown(result: dict[str, Any]) -> str:
    lines = [f"## {result['title']}", ""]
    env = result.get("environment", {})
    if env:
        lines += [
            f"_Measured {env.get('date', '')} on {env.get('device', '')}, torch {env.get('torch', '')}, "
            f"lightning {env.get('lightning', '')}; command: `{env.get('command', '')}`_",
            "",
        ]
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
    if targets:
        lines += ["| target | measured | met |", "|---|---|---|"]
        for t in targets:
            lines.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} |")
        lines.append("")
    if result.get("notes"):
        lines += [result["notes"], ""]
    return "\n".join(lines)


def environment(device: str, argv: list[str]) -> dict[str, str]:
    import lightning
    import torch

    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": name,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "command": "python -m benchmarks " + " ".join(argv),
    }


def write_combined(out_dir: Path) -> Path:
    parts = ["# Benchmark results", "", "Written by `python -m benchmarks` (see `benchmarks/__main__.py`). Do not edit by hand.", ""]
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
    parser.add_argument("--quick", action="store_true", help="smaller settings (smoke run)")
    parser.add_argument("--out", default=str(RESULTS), help="output folder")
    args = parser.parse_args(argv)
    names = args.only or discover()
    unknown = sorted(set(names) - set(discover()))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {discover()}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.device == "cpu" else f"_{args.device}"
    for name in names:
        module = importlib.import_module(f"benchmarks.bench_{name}")
        started = time.perf_counter()
        print(f"[benchmarks] {name} ...", flush=True)
        result = module.run(device=args.device, quick=args.quick)
        result["environment"] = environment(args.device, argv)
        result["seconds"] = round(time.perf_counter() - started, 1)
        (out_dir / f"{name}{suffix}.json").write_text(json.dumps(result, indent=2, default=str))
        (out_dir / f"{name}{suffix}.md").write_text(to_markdown(result))
        print(to_markdown(result), flush=True)
    combined = write_combined(out_dir)
    print(f"[benchmarks] wrote {combined}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
