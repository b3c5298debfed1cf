"""The GPU check: every headline figure measured on CUDA, in one command (docs/gpu.md).

    python3 scripts/gpu_check.py               # on the GPU machine (`make gpu-check`), results to $OUT too
    python3 scripts/gpu_check.py --dry-run     # anywhere, on CPU with tiny settings (CI runs this: < 1 minute)
    python3 scripts/gpu_check.py --dry-run --per-bench   # the same, one process per benchmark as on the GPU
    python3 scripts/gpu_check.py --list        # the parts and their time budgets

Parts run in order, each in its own process under a time budget; a part that overruns is stopped (its
process group killed) and recorded as ``timeout``, the rest still run, and the results are written
whatever happened:

* ``install``: the carried wheels (``.gpu-wheels/``, ``make gpu-wheels``) into a ``--target`` folder on
  ``PYTHONPATH`` with ``pip --no-index --no-deps``: the machine's torch is never replaced. The package
  itself runs from the checkout (``PYTHONPATH``), so nothing needs building.
* ``env``: GPU, driver, torch / CUDA / torchao / Lightning versions; every public name of the package
  imports.
* ``tests``: ``pytest -m cuda`` over the test files that hold CUDA-marked tests.
* ``bench:<name>``: ``python -m benchmarks --device cuda --quick --only <name>``, writing
  ``benchmarks/results/<name>_cuda.{json,md}``.
* ``suite``: the rest of the test suite (``-m "not cuda"``, pytest-xdist) in the time left: does it pass
  on the GPU machine's torch, with a GPU visible?

Then ``benchmarks/results/gpu_check_cuda.{json,md}`` (the parts, their status and time, the environment)
and, into ``--out`` (default ``$OUT``): that summary, ``gpu_check_results.tar.gz`` (results + logs) and
the console log. The dry run runs the same parts on CPU with ``--smoke`` settings (benchmarks in one
process unless ``--per-bench``), writes only into a scratch folder (``<name>_smoke.{json,md}``, the
CUDA results' layout, CPU-twin column included), and skips what needs the GPU machine (the wheel
install when no wheels are here, the ``suite`` part: CI runs the suite itself), saying so. On top of
the exit codes, a dry run fails a part whose output is not what the GPU run needs: no environment
line, no collected CUDA test, a benchmark's results missing or holding a row with an ``error``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_wheels  # noqa: E402  (scripts/ is not a package)

ROOT = gpu_wheels.ROOT
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS = (
    "estimate",
    "long_context",
    "training_memory",
    "memory",
    "auto_microbatch",
    "quantization",
    "lora",
    "optimizers",
    "loss_kernels",
)
DEADLINE_S = 450.0  # the whole real run stays inside 7.5 minutes (the device allows 10 per command)
DRY_DEADLINE_S = 600.0
BUNDLE_RESERVE_S = 15.0  # kept back for writing the results
MIN_PART_S = 20.0  # a part is not started with less time than this left
# seconds per part on the H200 (typical run: about half of these; the deadline bounds the sum)
BUDGETS = {
    "install": 45,
    "env": 45,
    "tests": 150,
    "bench:estimate": 75,
    "bench:long_context": 60,
    "bench:training_memory": 90,
    "bench:memory": 45,
    "bench:auto_microbatch": 60,
    "bench:quantization": 60,
    "bench:lora": 75,
    "bench:optimizers": 90,
    "bench:loss_kernels": 90,  # the chunked loss vs plain, Liger's and CCE's kernels (Triton compiles ~20 s)
    "suite": 240,
}
# the dry run on 2 CPU cores: install (with wheels) ~5 s, env ~10 s, tests ~12 s, bench ~30 s; the budgets
# leave room for a loaded machine, and stop a hang long before CI's own limit
DRY_BUDGETS = {"install": 60, "env": 90, "tests": 120, "bench": 300, "bench:one": 120}

ENV_SCRIPT = r"""
import importlib, importlib.metadata, json, subprocess, sys
info = {"python": sys.version.split()[0]}
import torch
info.update(torch=torch.__version__, cuda_build=str(torch.version.cuda), cuda_available=torch.cuda.is_available())
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                compute_capability=f"{props.major}.{props.minor}")
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        info["driver"] = out.splitlines()[0] if out else "unknown"
    except Exception:
        info["driver"] = "unknown"
for name in ("lightning", "torchmetrics", "torchao", "transformers", "jsonargparse", "torch_pruning", "zstandard", "lz4",
             "triton", "liger_kernel", "cut_cross_entropy"):
    try:
        module = importlib.import_module(name)  # liger_kernel has no __version__: its distribution's
        info[name] = getattr(module, "__version__", None) or importlib.metadata.version(name)
    except Exception as error:
        info[name] = f"missing ({type(error).__name__})"
import lightning_lowmem
info["lightning_lowmem"] = lightning_lowmem.__version__
info["lightning_lowmem_file"] = lightning_lowmem.__file__
for name in lightning_lowmem.__all__:  # every lazily exported name resolves under this torch
    getattr(lightning_lowmem, name)
info["public_names"] = len(lightning_lowmem.__all__)
print("ENV " + json.dumps(info))
"""


@dataclass
class Part:
    name: str
    budget_s: float
    command: list[str] | None  # None: done in this process
    note: str = ""


@dataclass
class Record:
    name: str
    status: str  # ok | failed | timeout | skipped
    seconds: float
    budget_s: float
    detail: str = ""
    log: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def cuda_test_files(tests: Path = ROOT / "tests") -> list[str]:
    """Test files holding ``cuda``-marked tests (a ``pytest.mark.cuda`` anywhere in the file)."""
    return sorted(str(p.relative_to(ROOT)) for p in tests.rglob("test_*.py") if "mark.cuda" in p.read_text())


def plan(dry_run: bool, scratch: Path, junit_dir: Path, per_bench: bool = False) -> list[Part]:
    """The parts of a real run, or of a dry run (CPU, tiny settings, scratch outputs).

    A dry run runs every benchmark in one process (``bench``), or with ``per_bench`` one process per
    benchmark (``bench:<name>``, as the GPU run does: each pays its own imports).
    """
    py = sys.executable
    # -v: one line per test, so a part cut at its budget (no JUnit file then) still says what passed
    tests = [
        py,
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-v",
        "-p",
        "no:cacheprovider",
        "-rfEs",
        "--timeout=120",
        f"--junitxml={junit_dir / 'tests_cuda.xml'}",
        *cuda_test_files(),
    ]
    install = [py, str(ROOT / "scripts" / "gpu_wheels.py"), "install", "--target", str(scratch / "site")]
    env = [py, "-c", ENV_SCRIPT]
    if dry_run:
        # the dry run installs for the GPU machine's Python (3.12), whatever runs it, into a scratch folder
        # that stays off PYTHONPATH: the install is exercised, what runs next uses this machine's packages
        install = [*install[:-2], "--target", str(scratch / "wheel-install"), "--cross"]
        smoke = [py, "-m", "benchmarks", "--device", "cpu", "--smoke", "--out", str(scratch / "results"), "--only"]
        if per_bench:
            benches = [
                Part(f"bench:{name}", DRY_BUDGETS["bench:one"], [*smoke, name], "CPU, --smoke settings")
                for name in BENCHMARKS
            ]
        else:
            benches = [
                Part(
                    "bench",
                    DRY_BUDGETS["bench"],
                    [*smoke, *BENCHMARKS],
                    "all benchmarks in one process, CPU, --smoke settings",
                )
            ]
        return [
            Part(
                "install",
                DRY_BUDGETS["install"],
                install if gpu_wheels.WHEELS.is_dir() else None,
                ""
                if gpu_wheels.WHEELS.is_dir()
                else "no .gpu-wheels/ here (CI never has it): the pinned list is checked only",
            ),
            Part("env", DRY_BUDGETS["env"], env),
            Part("tests", DRY_BUDGETS["tests"], tests, "no GPU: every cuda-marked test is collected and skipped"),
            *benches,
            Part("suite", 0, None, "skipped in a dry run: CI runs the suite itself"),
        ]
    parts = [
        Part("install", BUDGETS["install"], install),
        Part("env", BUDGETS["env"], env),
        Part("tests", BUDGETS["tests"], tests),
    ]
    for name in BENCHMARKS:
        command = [py, "-m", "benchmarks", "--device", "cuda", "--quick", "--only", name, "--out", str(RESULTS)]
        parts.append(Part(f"bench:{name}", BUDGETS[f"bench:{name}"], command))
    suite = [
        py,
        "-m",
        "pytest",
        "-m",
        "not cuda",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rfE",
        "-n",
        "8",
        "--timeout=300",
        f"--junitxml={junit_dir / 'suite.xml'}",
        "tests",
    ]
    parts.append(Part("suite", BUDGETS["suite"], suite, "the rest of the suite, in the time left"))
    return parts


def run_command(command: list[str], budget_s: float, env: dict[str, str], log: Path) -> tuple[str, float, int | None]:
    """Run ``command`` in its own process group for at most ``budget_s``; output to ``log``.

    Returns ``(status, seconds, returncode)``; on overrun the group gets SIGTERM, then SIGKILL 10 s later.
    """
    start = time.monotonic()
    with log.open("w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            out.write(f"\n[gpu_check] stopped after its budget of {budget_s:.0f} s\n")
            return "timeout", time.monotonic() - start, None
    return ("ok" if code == 0 else "failed"), time.monotonic() - start, code


def junit_counts(path: Path) -> dict[str, int] | None:
    """tests / failures / errors / skipped of a pytest junit XML file, or None if it is missing."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_parts(
    parts: list[Part], deadline_s: float, env: dict[str, str], logs: Path, junit_dir: Path, clock: Any = time.monotonic
) -> list[Record]:
    """Run ``parts`` in order; each gets its budget or what is left before ``deadline_s`` (from now)."""
    started = clock()
    records = []
    for part in parts:
        left = deadline_s - (clock() - started) - BUNDLE_RESERVE_S
        log = logs / f"{part.name.replace(':', '_')}.log"
        if part.command is None:
            if part.name == "install":  # dry run without wheels: the pinned list still parses
                try:
                    pins = gpu_wheels.read_pins()
                    records.append(
                        Record(part.name, "skipped", 0.0, part.budget_s, f"{part.note}: {len(pins)} pins OK")
                    )
                except ValueError as error:
                    records.append(Record(part.name, "failed", 0.0, part.budget_s, str(error)))
            else:
                records.append(Record(part.name, "skipped", 0.0, part.budget_s, part.note))
        elif left < MIN_PART_S:
            records.append(
                Record(part.name, "skipped", 0.0, part.budget_s, f"no time left ({left:.0f} s before the deadline)")
            )
        else:
            budget = min(part.budget_s, left)
            print(f"[gpu_check] {part.name}: running (budget {budget:.0f} s) ...", flush=True)
            status, seconds, code = run_command(part.command, budget, env, log)
            detail = part.note
            if status == "failed":
                detail = f"exit code {code}" + (f"; {part.note}" if part.note else "")
            elif status == "timeout":
                detail = f"cut at its budget of {budget:.0f} s"
            record = Record(
                part.name, status, round(seconds, 1), round(budget), detail, str(log.relative_to(logs.parent))
            )
            _enrich(record, log, junit_dir)
            records.append(record)
        last = records[-1]
        print(
            f"[gpu_check] {last.name}: {last.status} in {last.seconds:.1f} s {('- ' + last.detail) if last.detail else ''}",
            flush=True,
        )
        if last.status in ("failed", "timeout"):
            print(tail(log), flush=True)
    return records


def _enrich(record: Record, log: Path, junit_dir: Path) -> None:
    """Add what a part's output says: test counts, the environment, benchmark targets."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if record.name in ("tests", "suite"):
        counts = junit_counts(junit_dir / ("tests_cuda.xml" if record.name == "tests" else "suite.xml"))
        if counts is None and record.status == "timeout":  # no JUnit file: count the -v lines written so far
            found = re.findall(r"^\S+::\S+ (PASSED|FAILED|ERROR|SKIPPED)", text, re.MULTILINE)
            counts = {
                "tests": len(found),
                "failures": found.count("FAILED"),
                "errors": found.count("ERROR"),
                "skipped": found.count("SKIPPED"),
            }
        if counts:
            record.extra["counts"] = counts
            passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
            summary = (
                f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
            )
            record.detail = f"{summary}; {record.detail}" if record.detail else summary
    elif record.name == "env":
        match = re.search(r"^ENV (\{.*\})$", text, re.MULTILINE)
        if match:
            record.extra["environment"] = json.loads(match.group(1))
    elif record.name.startswith("bench"):
        missed = re.findall(r"^\| (.+?) \| (.+?) \| \*\*no\*\* \|", text, re.MULTILINE)
        met = len(re.findall(r"^\| .+? \| .+? \| yes \|", text, re.MULTILINE))
        record.extra["targets"] = {"met": met, "missed": [name for name, _ in missed]}
        if met or missed:
            record.detail = f"targets met {met}, missed {len(missed)}" + (f"; {record.detail}" if record.detail else "")


def check_dry_run(records: list[Record], results_dir: Path) -> None:
    """Fail the parts of a dry run whose output is not what the GPU run needs, though they exited 0.

    ``env``: the environment line, every public name counted, the package from this checkout; ``tests``:
    CUDA-marked tests collected; each benchmark: ``<name>_smoke.{json,md}`` written, its rows and targets
    present, no row holding an ``error`` (a benchmark catches a backend's failure into a row: on the GPU
    that is a result, in a dry run on CPU a broken code path), the Markdown with its CPU-twin column.
    """
    for record in records:
        if record.status != "ok":
            continue
        problems: list[str] = []
        if record.name == "env":
            environment = record.extra.get("environment")
            if not environment or not environment.get("public_names"):
                problems.append("no environment line (ENV {...}) in its output")
            elif not str(environment.get("lightning_lowmem_file", "")).startswith(str(ROOT)):
                problems.append(
                    f"lightning_lowmem imported from {environment.get('lightning_lowmem_file')}, not from {ROOT}"
                )
        elif record.name == "tests":
            if not record.extra.get("counts", {}).get("tests"):
                problems.append("no cuda-marked test collected")
        elif record.name.startswith("bench"):
            names = [record.name.removeprefix("bench:")] if ":" in record.name else list(BENCHMARKS)
            for name in names:
                problems += [f"{name}: {problem}" for problem in _smoke_problems(results_dir, name)]
        if problems:
            record.status = "failed"
            record.detail = "; ".join(problems) + (f" ({record.detail})" if record.detail else "")
            print(f"[gpu_check] {record.name}: failed the dry run's output check - {record.detail}", flush=True)


def _smoke_problems(results_dir: Path, name: str) -> list[str]:
    json_path, md_path = results_dir / f"{name}_smoke.json", results_dir / f"{name}_smoke.md"
    if not json_path.exists() or not md_path.exists():
        return [f"{json_path.name} / {md_path.name} not written"]
    result = json.loads(json_path.read_text())
    problems = [f"no {key}" for key in ("rows", "targets") if not result.get(key)]
    problems += [f"row {i} failed: {row['error']}" for i, row in enumerate(result.get("rows", [])) if "error" in row]
    if "CPU twin: measured (met)" not in md_path.read_text():
        problems.append(f"{md_path.name} lacks the CPU-twin column")
    return problems


def summary(records: list[Record], dry_run: bool, total_s: float, deadline_s: float) -> dict[str, Any]:
    """The run as a benchmark-style result (title, rows, targets, notes): ``gpu_check_cuda.json``."""
    environment = next((r.extra["environment"] for r in records if "environment" in r.extra), {})
    by_name = {r.name: r for r in records}
    benches = [r for r in records if r.name.startswith("bench")]
    tests = by_name.get("tests")
    targets = [
        {
            "target": "the dry run finishes inside its deadline (CPU: not a GPU timing)"
            if dry_run
            else "the whole check finishes well inside 8 minutes",
            "measured": f"{total_s:.0f} s (deadline {deadline_s:.0f} s)",
            "met": total_s <= (deadline_s if dry_run else 8 * 60),
        },
        {
            "target": "the package imports under the machine's torch (every public name)",
            "measured": f"torch {environment.get('torch', '?')}: {environment.get('public_names', 0)} names",
            "met": by_name.get("env") is not None and by_name["env"].status == "ok",
        },
        {
            "target": "every cuda-marked test passes",
            "measured": tests.detail if tests else "not run",
            "met": bool(tests and tests.status == "ok" and tests.extra.get("counts", {}).get("skipped", 1) == 0)
            or dry_run,
        },
        {
            "target": "every benchmark part completes within its budget",
            "measured": ", ".join(f"{r.name.removeprefix('bench:')} {r.status}" for r in benches) or "none run",
            "met": bool(benches) and all(r.status == "ok" for r in benches),
        },
    ]
    suite = by_name.get("suite")
    if suite is not None and suite.status != "skipped":
        targets.append(
            {
                "target": "the rest of the suite passes on the GPU machine",
                "measured": suite.detail,
                "met": suite.status == "ok",
            }
        )
    rows = [
        {"part": r.name, "status": r.status, "seconds": r.seconds, "budget_s": r.budget_s, "detail": r.detail}
        for r in records
    ]
    title = "GPU check: parts, status and time" + (" [dry run: CPU, tiny settings]" if dry_run else "")
    notes = (
        "Written by scripts/gpu_check.py (docs/gpu.md). Each part ran in its own process under its time budget; "
        "'timeout' = stopped at the budget, 'skipped' = not started (reason in detail). Figures: "
        "benchmarks/results/*_cuda.md; logs: gpu_check_logs/ in gpu_check_results.tar.gz."
    )
    env_line = {
        "date": time.strftime("%Y-%m-%d"),
        "device": environment.get("gpu", "CPU (dry run)" if dry_run else "no GPU found"),
        "driver": environment.get("driver", ""),
        "cuda": environment.get("cuda_build", ""),
        "torch": environment.get("torch", "?"),
        "lightning": environment.get("lightning", "?"),
        "command": "python3 scripts/gpu_check.py" + (" --dry-run" if dry_run else ""),
        **{k: v for k, v in environment.items() if k in ("torchao", "transformers", "python", "gpu_memory_gib")},
    }
    return {
        "title": title,
        "rows": rows,
        "targets": targets,
        "notes": notes,
        "environment": env_line,
        "parts": [asdict(r) for r in records],
    }


def bundle(
    result: dict[str, Any], results_dir: Path, logs: Path, out: Path, dry_run: bool, partial: bool = False
) -> list[Path]:
    """Write the summary beside the benchmark results and into ``out``, with a tarball of results + logs.

    A ``partial`` run (``--only``) writes its summary into ``out`` alone, as ``gpu_check_cuda_partial``:
    unpacking its tarball never replaces the summary of a full run.
    """
    sys.path.insert(0, str(ROOT))
    from benchmarks.__main__ import to_markdown, write_combined

    name = "gpu_check_dryrun" if dry_run else "gpu_check_cuda_partial" if partial else "gpu_check_cuda"
    summary_dir = out if partial and not dry_run else results_dir
    out.mkdir(parents=True, exist_ok=True)
    summary_dir.mkdir(parents=True, exist_ok=True)
    (summary_dir / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    (summary_dir / f"{name}.md").write_text(to_markdown(result))
    write_combined(results_dir)
    archive = out / "gpu_check_results.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        pattern = "*_smoke.*" if dry_run else "*_cuda.*"
        extra = [summary_dir / f"{name}.json", summary_dir / f"{name}.md"] if dry_run else []
        prefix = "dry_run/" if dry_run else ""  # unpacked into a checkout, a dry run's files land beside the results
        for path in sorted(results_dir.glob(pattern)) + extra + [results_dir / "README.md"]:
            if path.is_file():
                tar.add(path, arcname=f"{prefix}benchmarks/results/{path.name}")
        for path in sorted(logs.glob("*")):
            tar.add(path, arcname=f"{prefix}gpu_check_logs/{path.name}")
    written = [archive]
    for suffix in ("json", "md"):
        if summary_dir != out:
            shutil.copy(summary_dir / f"{name}.{suffix}", out / f"{name}.{suffix}")
        written.append(out / f"{name}.{suffix}")
    return written


class _Tee:
    """Console output also written to a log file (``--out``/gpu_check.log)."""

    def __init__(self, stream: Any, path: Path) -> None:
        self.stream, self.file = stream, path.open("w")

    def write(self, text: str) -> int:
        self.file.write(text)
        self.file.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the GPU check (``None``: it can): no torch, or no CUDA device."""
    try:
        import torch
    except ImportError:
        return f"{sys.executable} cannot import torch"
    if not torch.cuda.is_available():
        return f"torch.cuda.is_available() is False here (torch {torch.__version__}, CUDA build {torch.version.cuda})"
    return None


def select(parts: list[Part], only: list[str] | None) -> list[Part]:
    """Parts named in ``only`` (``bench`` selects every ``bench:<name>``), in run order."""
    if not only:
        return parts
    names = {p.name for p in parts}
    unknown = [
        name
        for name in only
        if name not in names and not (name == "bench" and any(n.startswith("bench") for n in names))
    ]
    if unknown:
        raise SystemExit(f"--only: unknown part(s) {unknown}; parts: {[p.name for p in parts]}")
    return [p for p in parts if p.name in only or ("bench" in only and p.name.startswith("bench"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny settings, scratch outputs (what CI runs)")
    parser.add_argument(
        "--per-bench",
        action="store_true",
        help="dry run: one process per benchmark (bench:<name>), as the GPU run; slower",
    )
    parser.add_argument(
        "--only",
        type=lambda s: [x for x in s.split(",") if x],
        default=None,
        help="comma-separated parts, e.g. install,env,bench:estimate ('bench' = every benchmark)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help=f"seconds for the whole run (default {DEADLINE_S:.0f}; dry run {DRY_DEADLINE_S:.0f})",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where the bundle goes (default $OUT, else a scratch folder)"
    )
    parser.add_argument("--list", action="store_true", help="print the parts and budgets, run nothing")
    args = parser.parse_args(argv)
    if not args.dry_run and not args.list:
        missing = no_gpu_reason()
        if missing is not None:  # before anything is deleted or written: no "no GPU found" results
            print(
                f"error: scripts/gpu_check.py (make gpu-check) needs a CUDA GPU: {missing}. Nothing was run or "
                "written. Run it on the GPU machine, or `make gpu-check-dry` (--dry-run) for the CPU check.",
                file=sys.stderr,
            )
            return 2
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    logs = scratch / "gpu_check_logs"
    logs.mkdir()
    parts = select(plan(args.dry_run, scratch, logs, per_bench=args.per_bench), args.only)
    if args.list:
        for part in parts:
            command = " ".join(part.command) if part.command else f"(in process) {part.note}"
            command = command.replace(ENV_SCRIPT, "ENV_SCRIPT")
            print(f"{part.name:24s} {part.budget_s:5.0f} s  {command}")
        return 0
    out = args.out or Path(os.environ.get("OUT") or scratch / "out")
    out.mkdir(parents=True, exist_ok=True)
    sys.stdout = _Tee(sys.stdout, out / "gpu_check.log")  # type: ignore[assignment]
    deadline = args.deadline or (DRY_DEADLINE_S if args.dry_run else DEADLINE_S)
    results_dir = scratch / "results" if args.dry_run else RESULTS
    if not args.dry_run:  # stale CUDA results of the parts about to run must not pass for new ones
        for part in parts:
            if part.name.startswith("bench:"):
                for stale in RESULTS.glob(f"{part.name.removeprefix('bench:')}_cuda.*"):
                    stale.unlink()
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(scratch / "site"), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    print(
        f"[gpu_check] {'dry run' if args.dry_run else 'GPU run'}: {len(parts)} parts, deadline {deadline:.0f} s, "
        f"scratch {scratch}, out {out}",
        flush=True,
    )
    started = time.monotonic()
    records = run_parts(parts, deadline, env, logs, logs)
    if args.dry_run:
        check_dry_run(records, results_dir)
    if (scratch / "site" / "torch").exists():  # only possible if someone pinned torch: it must never be carried
        records.append(
            Record(
                "install-check",
                "failed",
                0.0,
                0.0,
                "a torch package landed in the wheel target: remove it from the list",
            )
        )
    total = time.monotonic() - started
    result = summary(records, args.dry_run, total, deadline)
    written = bundle(result, results_dir, logs, out, args.dry_run, partial=bool(args.only))
    from benchmarks.__main__ import to_markdown

    print(to_markdown(result), flush=True)
    print(f"[gpu_check] wrote {', '.join(str(p) for p in written)}", flush=True)
    failed = [r.name for r in records if r.status in ("failed", "timeout")]
    if failed:
        print(f"[gpu_check] not ok: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
