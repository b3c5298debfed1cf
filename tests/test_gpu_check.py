"""scripts/gpu_check.py and scripts/gpu_wheels.py (the GPU check, docs/gpu.md) on CPU: the pinned wheel
list, the no-index install, time budgets that really stop a part (its whole process group), the summary
and bundle, the CUDA tables' CPU twins, and a dry run of the script itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402

from benchmarks.__main__ import main as benchmarks_main  # noqa: E402
from benchmarks.__main__ import to_markdown  # noqa: E402


# ----------------------------------------------------------------------------- the wheel list
def test_pinned_list_names_what_the_gpu_machine_lacks_and_never_torch():
    pins = gpu_wheels.read_pins()
    keys = {pin.key for pin in pins}
    assert {"torchao", "jsonargparse", "docstring_parser", "typeshed_client"} <= keys
    assert not keys & {"torch", "lightning", "pytorch_lightning", "torchmetrics", "transformers", "numpy"}


def test_pinned_list_rejects_loose_and_repeated_pins(tmp_path):
    loose = tmp_path / "loose.txt"
    loose.write_text("torchao>=0.18\n")
    with pytest.raises(ValueError, match=r"loose.txt:1: expected `name==version`, got 'torchao>=0.18'"):
        gpu_wheels.read_pins(loose)
    twice = tmp_path / "twice.txt"
    twice.write_text("lz4==4.4.5\n# a comment\nLZ4==4.4.4  # again\n")
    with pytest.raises(ValueError, match=r"\['lz4'\] pinned more than once"):
        gpu_wheels.read_pins(twice)


def _wheel(directory: Path, name: str = "lowmem_probe", version: str = "1.0") -> Path:
    """A minimal pure-Python wheel: one module that says its version."""
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}.py", f"VERSION = {version!r}\n")
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", f"{name}.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def test_check_says_which_wheel_is_missing_or_stray(tmp_path):
    pins = [gpu_wheels.Pin("lowmem-probe", "1.0")]
    with pytest.raises(FileNotFoundError, match=r"run `make gpu-wheels`"):
        gpu_wheels.check(tmp_path / "none", pins)
    with pytest.raises(FileNotFoundError, match=r"lacks \['lowmem-probe==1.0'\]"):
        gpu_wheels.check(tmp_path, pins)
    _wheel(tmp_path, version="0.9")
    with pytest.raises(ValueError, match=r"lowmem_probe-0.9-py3-none-any.whl is not pinned .*lowmem_probe==1.0"):
        gpu_wheels.check(tmp_path, pins)


def test_install_puts_wheels_in_the_target_without_an_index(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels)
    target = tmp_path / "site"
    installed = gpu_wheels.install(target, wheels, pins=[gpu_wheels.Pin("lowmem-probe", "1.0")])
    assert [p.name for p in installed] == ["lowmem_probe-1.0-py3-none-any.whl"]
    out = subprocess.run(
        [sys.executable, "-c", "import lowmem_probe; print(lowmem_probe.__file__, lowmem_probe.VERSION)"],
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == [str(target / "lowmem_probe.py"), "1.0"]


# ----------------------------------------------------------------------------- parts and budgets
def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_an_overrunning_part_is_stopped_with_its_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        f"import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)"
    )
    started = time.monotonic()
    status, seconds, code_ = gpu_check.run_command(_python(code), 2.0, dict(os.environ), tmp_path / "slow.log")
    assert status == "timeout" and code_ is None
    assert time.monotonic() - started < 20
    child = Path(f"/proc/{pid_file.read_text()}/stat")
    time.sleep(0.5)
    # the grandchild went with the group: gone, or a zombie waiting for init to reap it
    assert not child.exists() or child.read_text().split(")")[-1].split()[0] in ("Z", "X")
    assert "stopped after its budget of 2 s" in (tmp_path / "slow.log").read_text()


def test_parts_run_in_order_and_the_rest_still_runs_after_a_failure_or_an_overrun(tmp_path):
    parts = [
        gpu_check.Part("fails", 30, _python("import sys; print('boom'); sys.exit(3)")),
        gpu_check.Part("slow", 1.5, _python("import time; time.sleep(30)")),
        gpu_check.Part("ok", 60, _python("print('fine')")),
    ]
    records = gpu_check.run_parts(parts, 600.0, dict(os.environ), tmp_path, tmp_path)
    assert [(r.name, r.status) for r in records] == [("fails", "failed"), ("slow", "timeout"), ("ok", "ok")]
    assert records[0].detail == "exit code 3" and records[1].detail == "cut at its budget of 2 s"
    assert (tmp_path / "ok.log").read_text().strip().endswith("fine")


def test_a_part_gets_what_is_left_and_none_starts_too_close_to_the_deadline(tmp_path):
    now = iter([0.0, 0.0, 400.0, 440.0])  # the start, then before each part
    parts = [gpu_check.Part(name, 300, _python("print('ran')")) for name in ("first", "squeezed", "late")]
    records = gpu_check.run_parts(parts, 450.0, dict(os.environ), tmp_path, tmp_path, clock=lambda: next(now))
    assert [(r.name, r.status, r.budget_s) for r in records] == [
        ("first", "ok", 300),
        ("squeezed", "ok", 450 - 400 - gpu_check.BUNDLE_RESERVE_S),
        ("late", "skipped", 300),
    ]
    assert records[2].detail == "no time left (-5 s before the deadline)"


def test_summary_and_bundle_write_results_logs_and_out(tmp_path):
    logs, results, out = tmp_path / "logs", tmp_path / "results", tmp_path / "out"
    logs.mkdir()
    (logs / "env.log").write_text('ENV {"torch": "2.11.0", "public_names": 27}\n')
    junit = logs / "tests_cuda.xml"
    junit.write_text('<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1"/></testsuites>')
    env = gpu_check.Record("env", "ok", 3.0, 45, log="logs/env.log")
    gpu_check._enrich(env, logs / "env.log", logs)
    tests = gpu_check.Record("tests", "failed", 20.0, 120)
    gpu_check._enrich(tests, logs / "tests.log", logs)
    assert tests.detail == "3 passed, 1 failed, 0 errors, 1 skipped"
    cut = gpu_check.Record("tests", "timeout", 150.0, 150)  # no JUnit file: the -v lines are counted
    (logs / "cut.log").write_text("tests/a_cuda.py::test_x PASSED [ 10%]\ntests/a_cuda.py::test_y FAILED [ 20%]\n")
    gpu_check._enrich(cut, logs / "cut.log", tmp_path)
    assert cut.extra["counts"] == {"tests": 2, "failures": 1, "errors": 0, "skipped": 0}
    bench = gpu_check.Record("bench:estimate", "ok", 30.0, 75)
    (logs / "bench_estimate.log").write_text("| a target | 1.0 | yes |\n| another | 2.0 | **no** |\n")
    gpu_check._enrich(bench, logs / "bench_estimate.log", logs)
    assert bench.extra["targets"] == {"met": 1, "missed": ["another"]}
    result = gpu_check.summary([env, tests, bench], dry_run=False, total_s=200.0, deadline_s=450.0)
    met = {t["target"]: t["met"] for t in result["targets"]}
    assert met["the whole check finishes well inside 8 minutes"] and not met["every cuda-marked test passes"]
    assert result["environment"]["torch"] == "2.11.0"
    results.mkdir()
    (results / "estimate_cuda.json").write_text('{"title": "estimate (cuda)"}')
    (results / "estimate.json").write_text('{"title": "estimate (cpu)"}')  # a CPU result: not bundled
    written = gpu_check.bundle(result, results, logs, out, dry_run=False)
    assert {p.name for p in written} == {"gpu_check_results.tar.gz", "gpu_check_cuda.json", "gpu_check_cuda.md"}
    with tarfile.open(out / "gpu_check_results.tar.gz") as tar:
        names = set(tar.getnames())
    assert {
        "benchmarks/results/estimate_cuda.json",
        "benchmarks/results/gpu_check_cuda.json",
        "gpu_check_logs/env.log",
    } <= names
    assert "benchmarks/results/estimate.json" not in names
    assert json.loads((out / "gpu_check_cuda.json").read_text())["parts"][1]["status"] == "failed"
    # a partial run (--only) keeps its summary out of the results: unpacking it leaves a full run's alone
    written = gpu_check.bundle(result, results, logs, tmp_path / "partial", dry_run=False, partial=True)
    assert {p.name for p in written} == {
        "gpu_check_results.tar.gz",
        "gpu_check_cuda_partial.json",
        "gpu_check_cuda_partial.md",
    }
    assert not (results / "gpu_check_cuda_partial.json").exists()


def test_cuda_test_files_are_exactly_the_files_with_cuda_tests():
    files = gpu_check.cuda_test_files()
    assert "tests/planning/test_estimate_cuda.py" in files and "tests/callbacks/test_auto_microbatch_cuda.py" in files
    for path in (ROOT / "tests").rglob("test_*_cuda.py"):  # every *_cuda.py file is marked, so CPU runs skip it
        assert "pytestmark = pytest.mark.cuda" in path.read_text(), path


# ----------------------------------------------------------------------------- CUDA tables
def test_cuda_markdown_shows_each_target_beside_its_cpu_twin():
    result = {
        "title": "t",
        "environment": {
            "date": "2026-12-04",
            "device": "NVIDIA H200",
            "driver": "580.1",
            "cuda": "13.0",
            "torch": "2.11.0",
        },
        "targets": [
            {"target": "a", "measured": "1.0x", "met": True},
            {"target": "b on CUDA", "measured": "2%", "met": False, "twin": "b"},
            {"target": "c", "measured": "x", "met": True},
        ],
        "cpu_twin": {
            "file": "benchmarks/results/t.json",
            "date": "2026-12-03",
            "device": "CPU",
            "targets": {"a": {"measured": "0.9x", "met": True}, "b": {"measured": "1%", "met": True}},
        },
    }
    text = to_markdown(result)
    assert "on NVIDIA H200 (driver 580.1, CUDA 13.0)" in text
    assert "| a | 1.0x | yes | 0.9x (yes) |" in text
    assert "| b on CUDA | 2% | **no** | 1% (yes) |" in text
    assert "| c | x | yes | - |" in text


def test_smoke_runs_never_write_into_the_committed_results():
    with pytest.raises(SystemExit):
        benchmarks_main(["--smoke", "--only", "memory"])


# ----------------------------------------------------------------------------- the dry run itself
def _smoke_result(**changes: object) -> dict:
    result = {
        "title": "t [smoke run]",
        "rows": [{"method": "LoRA", "value": 1.0}],
        "targets": [{"target": "a", "measured": "1.0x", "met": True}],
        "cpu_twin": {"file": "benchmarks/results/t.json", "date": "-", "device": "CPU", "targets": {}},
    }
    return {**result, **changes}


def test_dry_run_fails_a_part_whose_output_the_gpu_run_could_not_use(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name in gpu_check.BENCHMARKS:
        result = (
            _smoke_result(rows=[{"method": "QLoRA int4", "error": "RuntimeError: boom"}])
            if name == "lora"
            else _smoke_result()
        )
        (results / f"{name}_smoke.json").write_text(json.dumps(result))
        (results / f"{name}_smoke.md").write_text(to_markdown(result))
    (results / "optimizers_smoke.md").unlink()
    (results / "memory_smoke.md").write_text("| target | measured | met |\n")  # no CPU-twin column
    package = str(ROOT / "lightning_lowmem" / "__init__.py")
    records = [
        gpu_check.Record(
            "env", "ok", 1.0, 90, extra={"environment": {"public_names": 28, "lightning_lowmem_file": package}}
        ),
        gpu_check.Record(
            "env",
            "ok",
            1.0,
            90,
            extra={"environment": {"public_names": 28, "lightning_lowmem_file": "/elsewhere/x.py"}},
        ),
        gpu_check.Record("env", "ok", 1.0, 90),
        gpu_check.Record(
            "tests", "ok", 1.0, 120, extra={"counts": {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}}
        ),
        gpu_check.Record(
            "tests", "ok", 1.0, 120, extra={"counts": {"tests": 26, "failures": 0, "errors": 0, "skipped": 26}}
        ),
        gpu_check.Record("bench", "ok", 1.0, 300, detail="all benchmarks in one process"),
        gpu_check.Record("bench:estimate", "ok", 1.0, 120),
        gpu_check.Record("bench:lora", "ok", 1.0, 120),
    ]
    gpu_check.check_dry_run(records, results)
    assert [r.status for r in records] == ["ok", "failed", "failed", "failed", "ok", "failed", "ok", "failed"]
    assert records[1].detail == f"lightning_lowmem imported from /elsewhere/x.py, not from {ROOT}"
    assert records[2].detail == "no environment line (ENV {...}) in its output"
    assert records[3].detail == "no cuda-marked test collected"
    assert records[5].detail == (
        "memory: memory_smoke.md lacks the CPU-twin column; lora: row 0 failed: RuntimeError: boom; "
        "optimizers: optimizers_smoke.json / optimizers_smoke.md not written (all benchmarks in one process)"
    )
    assert records[7].detail == "lora: row 0 failed: RuntimeError: boom"


def test_dry_run_bundle_keeps_its_files_apart_from_the_results(tmp_path):
    results, logs, out = tmp_path / "results", tmp_path / "logs", tmp_path / "out"
    results.mkdir()
    logs.mkdir()
    (results / "estimate_smoke.json").write_text(json.dumps(_smoke_result()))
    (logs / "bench.log").write_text("ran\n")
    result = gpu_check.summary(
        [gpu_check.Record("bench", "ok", 30.0, 300)], dry_run=True, total_s=40.0, deadline_s=600.0
    )
    written = gpu_check.bundle(result, results, logs, out, dry_run=True)
    assert {p.name for p in written} == {"gpu_check_results.tar.gz", "gpu_check_dryrun.json", "gpu_check_dryrun.md"}
    with tarfile.open(out / "gpu_check_results.tar.gz") as tar:
        names = set(tar.getnames())
    assert names == {
        "dry_run/benchmarks/results/estimate_smoke.json",
        "dry_run/benchmarks/results/gpu_check_dryrun.json",
        "dry_run/benchmarks/results/gpu_check_dryrun.md",
        "dry_run/benchmarks/results/README.md",
        "dry_run/gpu_check_logs/bench.log",
    }
    assert "## t [smoke run]" in (results / "README.md").read_text()


def test_dry_run_runs_one_process_per_benchmark_on_request(tmp_path):
    one = gpu_check.plan(True, tmp_path, tmp_path)
    per = gpu_check.plan(True, tmp_path, tmp_path, per_bench=True)
    assert [p.name for p in one if p.name.startswith("bench")] == ["bench"]
    assert [p.name for p in per if p.name.startswith("bench")] == [f"bench:{name}" for name in gpu_check.BENCHMARKS]
    assert all(
        p.command[-2:] == ["--only", p.name.removeprefix("bench:")] and "--smoke" in p.command
        for p in per
        if p.name.startswith("bench")
    )


def test_dry_run_script_end_to_end_without_the_heavy_parts(tmp_path):
    """The script's own flow (arguments, parts, summary, bundle, exit code) in a subprocess; CI runs every
    part after the suite (``make gpu-check-dry``), the env / tests / bench checks are tested above."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_check.py"),
            "--dry-run",
            "--only",
            "install",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check_dryrun.json").read_text())
    assert [(part["name"], part["status"]) for part in summary["parts"]] in (
        [("install", "skipped")],
        [("install", "ok")],
    )  # skipped: no .gpu-wheels/ here, the pinned list parsed
    assert summary["environment"]["command"] == "python3 scripts/gpu_check.py --dry-run"
    assert (tmp_path / "gpu_check_results.tar.gz").exists() and "install" in (tmp_path / "gpu_check.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine this would start the real GPU check")
def test_the_gpu_run_without_a_gpu_refuses_and_writes_nothing(tmp_path):
    """It once ran every part and wrote benchmarks/results/gpu_check_cuda.* saying "no GPU found"."""
    results = ROOT / "benchmarks" / "results"
    before = {path: path.stat().st_mtime_ns for path in results.iterdir()}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: scripts/gpu_check.py (make gpu-check) needs a CUDA GPU: ")
    assert "make gpu-check-dry" in result.stderr and result.stderr.count("\n") == 1 and not result.stdout
    assert list(tmp_path.iterdir()) == []
    assert {path: path.stat().st_mtime_ns for path in results.iterdir()} == before
