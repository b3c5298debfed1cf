"""``lowmem demo``: baseline vs the low-memory stack on the embedded workloads, in one table.

* ``charlm`` (training memory): plain fp32 AdamW vs Lightning ``bf16-true`` vs the lowmem training stack
  (``bf16-true`` + ``ActivationCheckpointing("Block")`` + ``ActivationCompression("int8")`` + Adafactor
  stepped inside backward). Peak training memory by category (one step measured with the memory core),
  step time, validation loss.
* ``digits`` (shipping size / accuracy): a float MLP vs ``ScheduledPruning`` to 90% (sparse export),
  ``PostTrainingQuantization`` int8, and a ``DistillationModule`` student 16x smaller, quantized to int8.
  Test accuracy and the bytes of the file you would ship.

On a CPU without bf16 instructions (bf16 is emulated, tens of times slower) the bf16 rows train only the
steps their memory figures need (a step's memory does not change with more steps) and the stack is also
trained in fp32 for the loss comparison; the table says so.

Each run prints a header (``[2/7] charlm · Lightning bf16-true``) and a progress bar counted in steps;
``<out>/demo.json`` is rewritten after every run (``"complete": false`` until the end). Ctrl-C or SIGTERM
stops the whole demo after cleaning up the running fit (exit code 130 / 143). At the end: one Rich table
and ``<out>/memory.png`` (breakdown per configuration, live memory within one step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

from lightning_lowmem.demo.charlm_runs import BASELINE_LABEL, STACK_LABEL, charlm_plan
from lightning_lowmem.demo.digits_runs import digits_plan
from lightning_lowmem.demo.rows import DemoRun, DemoSettings, model_bytes, settings_for
from lightning_lowmem.demo.timing import pinned_threads
from lightning_lowmem.memory import format_bytes

# the rows live in rows.py / charlm_runs.py / digits_runs.py; these names stay importable from here
__all__ = [
    "DemoInterrupted",
    "DemoRun",
    "DemoSettings",
    "charlm_plan",
    "digits_plan",
    "main",
    "model_bytes",
    "run_demo",
    "settings_for",
    "stop_on_signals",
    "table",
    "write_results",
]


# ----------------------------------------------------------------------------- output
def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base in (None, 0):
        return ""
    return f" ({value / base:.2f}x)"


def table(runs: list[DemoRun], title: str = "") -> Any:
    """The Rich table of ``runs``; ratios are against each workload's first row."""
    from rich.table import Table

    out = Table(
        title=title or "lightning_lowmem demo: baseline vs low-memory stack (ratios vs each workload's baseline)"
    )
    columns = (
        "workload",
        "configuration",
        "steps",
        "peak train memory",
        "params/grads/optim/acts",
        "step",
        "model size",
        "metric",
        "notes",
    )
    for column in columns:
        out.add_column(
            column,
            justify="left" if column in ("workload", "configuration", "notes") else "right",
            no_wrap=column not in ("configuration", "notes"),
        )
    base: dict[str, DemoRun] = {}
    for run in runs:
        ref = base.setdefault(run.workload, run)
        parts = (
            "/".join(
                format_bytes(run.breakdown.get(k, 0)).replace(" ", "")
                for k in ("parameters", "gradients", "optimizer_state", "activations")
            )
            if run.breakdown
            else "-"
        )
        out.add_row(
            run.workload,
            run.name,
            str(run.steps),
            (format_bytes(run.peak_bytes) + _ratio(run.peak_bytes, ref.peak_bytes)) if run.peak_bytes else "-",
            parts,
            f"{run.step_ms:.1f} ms{_ratio(run.step_ms, ref.step_ms)}" if run.step_ms else "-",
            (format_bytes(run.model_bytes) + _ratio(run.model_bytes, ref.model_bytes)) if run.model_bytes else "-",
            f"{run.metric_name} {run.metric:.4f}" if run.metric is not None else "-",
            run.notes,
        )
    return out


def write_results(
    path: Path,
    runs: list[DemoRun],
    settings: DemoSettings,
    complete: bool,
    seconds: float,
    interrupted_by: str | None = None,
) -> None:
    """``demo.json``: the runs so far; written after every run, so an interrupted demo leaves them."""
    payload = {
        "complete": complete,
        "interrupted_by": interrupted_by,
        "seconds": round(seconds, 1),
        "settings": asdict(settings),
        "runs": [asdict(run) for run in runs],
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)


# ----------------------------------------------------------------------------- signals
class DemoInterrupted(BaseException):
    """Ctrl-C / SIGTERM: stop the whole demo. A ``BaseException`` but not ``KeyboardInterrupt``, so
    Lightning tears the running fit down and re-raises it (its ``KeyboardInterrupt`` path would
    ``sys.exit`` instead)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn the first SIGINT / SIGTERM into :class:`DemoInterrupted`; later ones are ignored while the
    running fit cleans up. The previous handlers are restored on exit."""
    fired: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if fired:
            return
        fired.append(signum)
        raise DemoInterrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """No per-Trainer banners ("GPU available ...", tips) between the demo's own headers."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = logger.level
    logger.setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*LeafSpec.*")
        try:
            yield
        finally:
            logger.setLevel(level)


# ----------------------------------------------------------------------------- main
def _summary(run: DemoRun) -> str:
    parts = [f"{run.steps} steps in {run.seconds:.0f} s"]
    if run.peak_bytes:
        parts.append(f"peak {format_bytes(run.peak_bytes)}")
    if run.metric is not None:
        parts.append(f"{run.metric_name} {run.metric:.4f}")
    if run.model_bytes and run.workload == "digits":
        parts.append(f"model {format_bytes(run.model_bytes)}")
    return ", ".join(parts)


def run_demo(settings: DemoSettings, workloads: list[str], out: Path, console: Any) -> tuple[list[DemoRun], str | None]:
    """Run the planned rows one by one, printing a header per run and rewriting ``demo.json`` after
    each; returns the runs and the name of the signal that stopped the demo (or ``None``)."""
    plan = (charlm_plan(settings) if "charlm" in workloads else []) + (
        digits_plan(settings) if "digits" in workloads else []
    )
    runs: list[DemoRun] = []
    context: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        with stop_on_signals(), _quiet_lightning(), pinned_threads(settings.threads):
            for index, (workload, name, fn) in enumerate(plan, 1):
                console.print(
                    f"[bold][{index}/{len(plan)}][/bold] {workload} · {name}", highlight=False, soft_wrap=True
                )
                run_started = time.perf_counter()
                run = fn(settings, context, f"{index}/{len(plan)} {workload}")
                run.seconds = round(time.perf_counter() - run_started, 1)
                runs.append(run)
                console.print(f"      done: {_summary(run)}", highlight=False, soft_wrap=True)
                write_results(out / "demo.json", runs, settings, complete=False, seconds=time.perf_counter() - started)
    except DemoInterrupted as stop:
        write_results(
            out / "demo.json",
            runs,
            settings,
            complete=False,
            seconds=time.perf_counter() - started,
            interrupted_by=str(stop),
        )
        return runs, str(stop)
    return runs, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lowmem demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a ~1 minute version (a smaller charlm, fewer steps and epochs)"
    )
    parser.add_argument("--out", default="demo_output", help="folder for demo.json and memory.png")
    parser.add_argument("--workloads", nargs="*", default=["charlm", "digits"], choices=["charlm", "digits"])
    parser.add_argument(
        "--bf16",
        default="auto",
        choices=["auto", "full", "short"],
        help="bf16 rows: train all steps (full), only the steps memory needs (short), or short "
        "when this CPU emulates bf16 (auto, default)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1, see pinned_threads)")
    args = parser.parse_args(argv)
    from rich.console import Console

    console = Console() if Console().is_terminal else Console(width=200)
    started = time.perf_counter()
    settings = settings_for(args.quick, args.bf16)
    settings.threads = max(1, args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    count = len(charlm_plan(settings)) * ("charlm" in args.workloads) + 4 * ("digits" in args.workloads)
    console.print(f"lowmem demo{' --quick' if args.quick else ''}: {count} runs, results in {out}/", highlight=False)
    if settings.bf16_short and "charlm" in args.workloads:
        console.print(f"  bf16: {settings.bf16_reason}", highlight=False, soft_wrap=True)
        console.print(
            f"  so the bf16 rows train {settings.profile_step + 1} steps (enough for their memory figures); "
            "the loss is compared on full-length rows",
            highlight=False,
            soft_wrap=True,
        )
    runs, stopped = run_demo(settings, args.workloads, out, console)
    if stopped:
        if runs:
            console.print(table(runs, title=f"lightning_lowmem demo (interrupted: {len(runs)}/{count} runs)"))
        console.print(
            f"interrupted by {stopped} after {len(runs)}/{count} runs; partial results in {out / 'demo.json'}",
            highlight=False,
        )
        return 128 + int(getattr(signal, stopped, signal.SIGINT))
    shape = settings.charlm_model
    console.print(
        table(
            runs,
            title="lightning_lowmem demo: baseline vs low-memory stack (ratios vs each workload's "
            f"baseline; charlm {shape['n_layer']}x{shape['n_embd']}, batch {settings.charlm_batch_size}x"
            f"{shape['block_size']})",
        )
    )
    if settings.bf16_short and "charlm" in args.workloads:
        console.print(
            f"bf16 rows: memory only ({settings.bf16_reason}); a step's memory does not change with more "
            "steps. `--bf16 full` trains them fully.",
            highlight=False,
            soft_wrap=True,
        )
    from lightning_lowmem.demo.plots import plot_memory

    charlm = [run for run in runs if run.workload == "charlm"]
    png = plot_memory(
        charlm,
        out / "memory.png",
        traced=[run for run in charlm if run.label in (BASELINE_LABEL, STACK_LABEL)],
        title=f"charlm ({shape['n_layer']} layers x {shape['n_embd']}, batch {settings.charlm_batch_size} x "
        f"{shape['block_size']}): one training step, measured",
    )
    seconds = time.perf_counter() - started
    write_results(out / "demo.json", runs, settings, complete=True, seconds=seconds)
    console.print(
        f"wrote {out / 'demo.json'}" + (f" and {png}" if png else "") + f" in {seconds:.0f} s", highlight=False
    )
    return 0
