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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning as L
import torch

from lightning_lowmem.demo.charlm import CharLM, CharLMDataModule
from lightning_lowmem.demo.digits import DigitsClassifier, DigitsDataModule
from lightning_lowmem.demo.step_profile import StepMemoryProfile
from lightning_lowmem.demo.timing import StepProgress, StepTimer, bf16_speed, pinned_threads
from lightning_lowmem.memory import format_bytes


@dataclass
class DemoRun:
    """One row of the demo table."""

    workload: str
    name: str
    label: str = ""
    steps: int = 0
    peak_bytes: int | None = None
    breakdown: dict[str, int] = field(default_factory=dict)
    step_ms: float | None = None
    model_bytes: int | None = None
    metric_name: str = ""
    metric: float | None = None
    timeline: list[tuple[str, int]] = field(default_factory=list)
    memory_only: bool = False
    seconds: float = 0.0
    notes: str = ""


@dataclass
class DemoSettings:
    """What the demo runs. ``bf16_short``: bf16 rows train ``profile_step + 1`` steps (memory only)."""

    quick: bool
    charlm_steps: int
    digits_epochs: int
    bf16_short: bool = False
    bf16_reason: str = ""
    charlm_model: dict[str, int] = field(default_factory=lambda: dict(n_layer=6, n_head=4, n_embd=128, block_size=64))
    charlm_batch_size: int = 32
    charlm_chars: int = 1_500_000
    val_batches: int = 20
    profile_step: int = 1
    threads: int = 1  # torch intra-op threads of every run (the benchmarks' choice; see run_demo)


def settings_for(quick: bool, bf16: str = "auto") -> DemoSettings:
    """The demo's settings; ``bf16`` is ``"auto"`` (detect emulated bf16), ``"full"`` or ``"short"``."""
    if bf16 not in ("auto", "full", "short"):
        raise ValueError(f"`bf16`={bf16!r} is unknown; choose 'auto', 'full' or 'short'")
    if bf16 == "auto":
        speed = bf16_speed()
        short, reason = speed.emulated, speed.reason
    else:
        short, reason = bf16 == "short", f"--bf16 {bf16}"
    if quick:  # a smaller charlm (4 layers, batch 16): the same story in a third of the compute
        return DemoSettings(
            quick=True,
            charlm_steps=20,
            digits_epochs=2,
            bf16_short=short,
            bf16_reason=reason,
            charlm_model=dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
            charlm_batch_size=16,
            charlm_chars=300_000,
            val_batches=8,
        )
    return DemoSettings(quick=False, charlm_steps=200, digits_epochs=12, bf16_short=short, bf16_reason=reason)


def _trainer(
    title: str, max_steps: int = -1, max_epochs: int | None = None, callbacks: list[Any] = (), **kwargs: Any
) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        max_epochs=max_epochs,
        callbacks=[*callbacks, StepProgress(title)],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def model_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's state dict as ``torch.save`` would store them (quantized tensors included)."""
    import io

    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    return buffer.getbuffer().nbytes


# ----------------------------------------------------------------------------- charlm
# The full stack of examples/configs/full_stack.yaml: Adafactor (factored state) stepped inside backward, so
# gradients are freed one parameter at a time; its lr is relative to each weight's RMS.
STACK_OPTIMIZER, STACK_LR = "adafactor_in_backward", 0.05
BASELINE_LABEL, STACK_LABEL = "fp32 AdamW (baseline)", "lowmem stack (bf16-true)"


def _charlm_stack() -> list[Any]:
    from lightning_lowmem.callbacks.activation_checkpointing import ActivationCheckpointing
    from lightning_lowmem.callbacks.activation_compression import ActivationCompression

    return [ActivationCheckpointing("Block"), ActivationCompression("int8", log_stats=False)]


def _charlm_run(
    settings: DemoSettings,
    context: dict[str, Any],
    title: str,
    name: str,
    label: str,
    precision: str = "32-true",
    optimizer: str = "adamw",
    lr: float = 3e-3,
    callbacks: Callable[[], list[Any]] = list,
) -> DemoRun:
    memory_only = settings.bf16_short and precision.startswith("bf16")
    steps = settings.profile_step + 1 if memory_only else settings.charlm_steps
    if "charlm_data" not in context:  # one corpus read for every charlm row
        context["charlm_data"] = CharLMDataModule(
            block_size=settings.charlm_model["block_size"],
            batch_size=settings.charlm_batch_size,
            max_chars=settings.charlm_chars,
        )
    torch.manual_seed(0)
    profile, timer = StepMemoryProfile(step=settings.profile_step), StepTimer(skip_first=3)
    model = CharLM(**settings.charlm_model, optimizer=optimizer, lr=lr)
    trainer = _trainer(
        title,
        max_steps=steps,
        callbacks=[profile, timer, *callbacks()],
        precision=precision,
        limit_val_batches=0 if memory_only else settings.val_batches,
        val_check_interval=steps,
    )
    trainer.fit(model, context["charlm_data"])
    report = profile.report
    run = DemoRun(
        workload="charlm",
        name=name,
        label=label,
        steps=trainer.global_step,
        peak_bytes=report.peak_bytes if report else None,
        breakdown=dict(report.breakdown) if report else {},
        model_bytes=model_bytes(trainer.lightning_module),
        metric_name="val_loss",
        timeline=profile.timeline,
        memory_only=memory_only,
    )
    if memory_only:
        run.notes = f"bf16 is emulated on this CPU: {steps} steps, memory only"
    else:
        run.step_ms = 1000 * timer.median_s
        run.metric = float(trainer.callback_metrics["val_loss"])
    return run


def charlm_plan(settings: DemoSettings) -> list[tuple[str, str, Callable[..., DemoRun]]]:
    """``(workload, name, run_fn)`` of each charlm row; ``run_fn(settings, context, title)``."""

    def run(name: str, label: str, **kwargs: Any) -> tuple[str, str, Callable[..., DemoRun]]:
        return "charlm", name, lambda s, c, t: _charlm_run(s, c, t, name, label, **kwargs)

    stack = dict(optimizer=STACK_OPTIMIZER, lr=STACK_LR, callbacks=_charlm_stack)
    rows = [
        run("plain fp32 AdamW (baseline)", BASELINE_LABEL),
        run("Lightning bf16-true", "Lightning bf16-true", precision="bf16-true"),
        run(f"lowmem: bf16-true + ckpt + int8 acts + {STACK_OPTIMIZER}", STACK_LABEL, precision="bf16-true", **stack),
    ]
    if settings.bf16_short:  # the stack's loss, measured where training is long enough
        rows.append(
            run(
                f"lowmem stack in fp32: ckpt + int8 acts + {STACK_OPTIMIZER} (loss check)",
                "lowmem stack (fp32)",
                **stack,
            )
        )
    return rows


# ----------------------------------------------------------------------------- digits
DIGITS_HIDDEN = 256


def sparse_model_bytes(module: torch.nn.Module) -> int:
    """Bytes of the state dict saved with pruned tensors as bitmask + non-zero values."""
    import io

    from lightning_lowmem.functional.pruning.unstructured import to_sparse_state_dict

    buffer = io.BytesIO()
    torch.save(to_sparse_state_dict(module.state_dict()), buffer)
    return buffer.getbuffer().nbytes


def _digits_run(
    settings: DemoSettings,
    title: str,
    name: str,
    model: L.LightningModule | None = None,
    callbacks: Callable[[], list[Any]] = list,
    epochs: int | None = None,
) -> tuple[DemoRun, L.LightningModule]:
    torch.manual_seed(0)
    model = model if model is not None else DigitsClassifier(arch="mlp", hidden=DIGITS_HIDDEN)
    data = DigitsDataModule(batch_size=64)
    profile, timer = StepMemoryProfile(step=settings.profile_step), StepTimer()
    trainer = _trainer(
        title,
        max_epochs=epochs or settings.digits_epochs,
        callbacks=[profile, timer, *callbacks()],
        limit_val_batches=0,
    )
    trainer.fit(model, data)
    test = trainer.test(trainer.lightning_module, data, verbose=False)[0]
    report = profile.report
    run = DemoRun(
        workload="digits",
        name=name,
        label=name.split(" (")[0],
        steps=trainer.global_step,
        peak_bytes=report.peak_bytes if report else None,
        breakdown=dict(report.breakdown) if report else {},
        step_ms=1000 * timer.median_s,
        model_bytes=model_bytes(model.student if hasattr(model, "student") else model),
        metric_name="test_acc",
        metric=float(test["test_acc"]),
    )
    return run, model


def digits_plan(settings: DemoSettings) -> list[tuple[str, str, Callable[..., DemoRun]]]:
    """``(workload, name, run_fn)`` of each digits row; the distilled row uses the baseline as teacher."""
    steps = settings.digits_epochs * 23  # 1437 training images / batch 64

    def baseline(s: DemoSettings, context: dict[str, Any], title: str) -> DemoRun:
        run, context["teacher"] = _digits_run(s, title, names[0])
        return run

    def pruned(s: DemoSettings, context: dict[str, Any], title: str) -> DemoRun:
        from lightning_lowmem.callbacks.scheduled_pruning import ScheduledPruning
        from lightning_lowmem.functional.pruning.unstructured import sparsity

        def pruning() -> list[Any]:
            return [
                ScheduledPruning(
                    "l1_unstructured",
                    parameter_names=["weight"],
                    schedule="cubic",
                    target_sparsity=0.9,
                    start_step=steps // 10,
                    end_step=steps * 2 // 3,
                    frequency=5,
                )
            ]

        run, model = _digits_run(s, title, names[1], callbacks=pruning)
        run.model_bytes = sparse_model_bytes(model)
        run.notes = f"sparsity {sparsity(model):.1%}"
        return run

    def quantized(s: DemoSettings, context: dict[str, Any], title: str) -> DemoRun:
        from lightning_lowmem.callbacks.post_training_quantization import PostTrainingQuantization

        return _digits_run(s, title, names[2], callbacks=lambda: [PostTrainingQuantization("int8_dynamic")])[0]

    def distilled(s: DemoSettings, context: dict[str, Any], title: str) -> DemoRun:
        from lightning_lowmem.demo.digits import digits_mlp
        from lightning_lowmem.distillation import DistillationModule
        from lightning_lowmem.functional.quantization.ptq import quantize_

        teacher = context["teacher"]
        teacher.freeze()
        student = DistillationModule(
            student=digits_mlp(DIGITS_HIDDEN // 4, 2), teacher=teacher, temperature=4.0, alpha=0.9, lr=1e-2
        )
        run, student = _digits_run(s, title, names[3], model=student, epochs=s.digits_epochs * 2)
        quantize_(student.student, "int8_dynamic")
        tester = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
        run.metric = float(tester.test(student, DigitsDataModule(batch_size=64), verbose=False)[0]["test_acc"])
        run.model_bytes = model_bytes(student.student)
        return run

    names = [
        f"float MLP 2x{DIGITS_HIDDEN} (baseline)",
        "ScheduledPruning 90% (cubic), sparse export",
        "PostTrainingQuantization int8_dynamic",
        f"DistillationModule 2x{DIGITS_HIDDEN // 4} student + int8",
    ]
    return [("digits", name, fn) for name, fn in zip(names, (baseline, pruned, quantized, distilled), strict=True)]


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
