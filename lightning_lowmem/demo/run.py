"""``lowmem demo``: baseline vs the low-memory stack on the embedded workloads, in one table.

* ``charlm`` (training memory): plain fp32 AdamW vs Lightning ``bf16-true`` vs the lowmem training stack
  (``bf16-true`` + ``ActivationCheckpointing("Block")`` + ``ActivationCompression("int8")`` + AdamW
  stepped inside backward). Peak training memory by category (memory core, sampled steps), step time, validation loss.
* ``digits`` (shipping size / accuracy): a float MLP vs ``ScheduledPruning`` to 90% (sparse export),
  ``PostTrainingQuantization`` int8, and a ``DistillationModule`` student 16x smaller, quantized to int8.
  Test accuracy and the bytes of the file you would ship.

Writes ``<out>/demo.json`` and ``<out>/memory_over_steps.png`` and prints one Rich table.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch

from lightning_lowmem.callbacks.memory_monitor import MemoryMonitor
from lightning_lowmem.demo.charlm import CharLM, CharLMDataModule
from lightning_lowmem.demo.digits import DigitsClassifier, DigitsDataModule
from lightning_lowmem.demo.timing import StepTimer
from lightning_lowmem.memory import format_bytes


@dataclass
class DemoRun:
    """One row of the demo table."""

    workload: str
    name: str
    peak_bytes: int | None = None
    breakdown: dict[str, int] = field(default_factory=dict)
    step_ms: float | None = None
    model_bytes: int | None = None
    metric_name: str = ""
    metric: float | None = None
    memory_curve: list[tuple[int, int]] = field(default_factory=list)
    notes: str = ""


@dataclass
class DemoSettings:
    quick: bool
    charlm_steps: int
    digits_epochs: int
    deep_every: int


def _settings(quick: bool) -> DemoSettings:
    if quick:
        return DemoSettings(quick=True, charlm_steps=30, digits_epochs=3, deep_every=10)
    return DemoSettings(quick=False, charlm_steps=200, digits_epochs=12, deep_every=25)


def _trainer(max_steps: int = -1, max_epochs: int | None = None, callbacks: list[Any] = (), **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        max_epochs=max_epochs,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=True,
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
CHARLM = dict(n_layer=6, n_head=4, n_embd=128, block_size=64)


def _charlm_data(settings: DemoSettings) -> CharLMDataModule:
    return CharLMDataModule(block_size=64, batch_size=32, max_chars=400_000 if settings.quick else 1_500_000)


def _charlm_run(
    name: str,
    settings: DemoSettings,
    precision: str = "32-true",
    optimizer: str = "adamw",
    lr: float = 3e-3,
    callbacks: Callable[[], list[Any]] = list,
) -> DemoRun:
    torch.manual_seed(0)
    monitor = MemoryMonitor(deep_every_n_steps=settings.deep_every, summary=False)
    timer = StepTimer(skip_first=3)
    model = CharLM(**CHARLM, optimizer=optimizer, lr=lr)
    trainer = _trainer(
        max_steps=settings.charlm_steps,
        callbacks=[monitor, timer, *callbacks()],
        precision=precision,
        limit_val_batches=20,
        val_check_interval=settings.charlm_steps,
    )
    trainer.fit(model, _charlm_data(settings))
    report = monitor.last_report
    deep = [(int(r["step"]), int(r["peak"])) for r in monitor.history if "peak" in r]
    return DemoRun(
        workload="charlm",
        name=name,
        peak_bytes=max(p for _, p in deep) if deep else None,
        breakdown=dict(report.breakdown) if report else {},
        step_ms=1000 * timer.median_s,
        model_bytes=model_bytes(trainer.lightning_module),
        metric_name="val_loss",
        metric=float(trainer.callback_metrics["val_loss"]),
        memory_curve=deep,
    )


def _charlm_stack() -> list[Any]:
    from lightning_lowmem.callbacks.activation_checkpointing import ActivationCheckpointing
    from lightning_lowmem.callbacks.activation_compression import ActivationCompression

    return [ActivationCheckpointing("Block"), ActivationCompression("int8", log_stats=False)]


# The full stack of examples/configs/full_stack.yaml: Adafactor (factored state) stepped inside backward, so
# gradients are freed one parameter at a time; its lr is relative to each weight's RMS.
STACK_OPTIMIZER, STACK_LR = "adafactor_in_backward", 0.05


def charlm_runs(settings: DemoSettings) -> list[DemoRun]:
    return [
        _charlm_run("plain fp32 AdamW (baseline)", settings),
        _charlm_run("Lightning bf16-true", settings, precision="bf16-true"),
        _charlm_run(
            f"lowmem: bf16-true + ckpt + int8 acts + {STACK_OPTIMIZER}",
            settings,
            precision="bf16-true",
            optimizer=STACK_OPTIMIZER,
            lr=STACK_LR,
            callbacks=_charlm_stack,
        ),
    ]


# ----------------------------------------------------------------------------- digits
DIGITS_HIDDEN = 256


def _digits_run(
    name: str,
    settings: DemoSettings,
    model: L.LightningModule | None = None,
    callbacks: Callable[[], list[Any]] = list,
    shipped: Callable[[torch.nn.Module], int] | None = None,
    epochs: int | None = None,
) -> tuple[DemoRun, L.LightningModule]:
    torch.manual_seed(0)
    model = model if model is not None else DigitsClassifier(arch="mlp", hidden=DIGITS_HIDDEN)
    data = DigitsDataModule(batch_size=64)
    monitor = MemoryMonitor(deep_every_n_steps=0 if settings.quick else 50, summary=False)
    timer = StepTimer()
    trainer = _trainer(
        max_epochs=epochs or settings.digits_epochs, callbacks=[monitor, timer, *callbacks()], limit_val_batches=0
    )
    trainer.fit(model, data)
    test = trainer.test(trainer.lightning_module, data, verbose=False)[0]
    report = monitor.last_report
    shipped_module = model.student if hasattr(model, "student") else model
    run = DemoRun(
        workload="digits",
        name=name,
        peak_bytes=report.peak_bytes if report else None,
        breakdown=dict(report.breakdown) if report else {},
        step_ms=1000 * timer.median_s,
        model_bytes=(shipped or model_bytes)(shipped_module),
        metric_name="test_acc",
        metric=float(test["test_acc"]),
    )
    return run, model


def sparse_model_bytes(module: torch.nn.Module) -> int:
    """Bytes of the state dict saved with pruned tensors as bitmask + non-zero values."""
    import io

    from lightning_lowmem.functional.pruning import to_sparse_state_dict

    buffer = io.BytesIO()
    torch.save(to_sparse_state_dict(module.state_dict()), buffer)
    return buffer.getbuffer().nbytes


def digits_runs(settings: DemoSettings) -> list[DemoRun]:
    from lightning_lowmem.callbacks.post_training_quantization import PostTrainingQuantization
    from lightning_lowmem.callbacks.scheduled_pruning import ScheduledPruning
    from lightning_lowmem.demo.digits import digits_mlp
    from lightning_lowmem.distillation import DistillationModule
    from lightning_lowmem.functional.pruning import sparsity

    steps = settings.digits_epochs * 23  # 1437 training images / batch 64

    def pruning() -> list[Any]:
        return [
            ScheduledPruning(
                "l1_unstructured", parameter_names=["weight"], schedule="cubic", target_sparsity=0.9,
                start_step=steps // 10, end_step=steps * 2 // 3, frequency=5,
            )
        ]

    baseline, teacher = _digits_run(f"float MLP 2x{DIGITS_HIDDEN} (baseline)", settings)
    pruned, pruned_model = _digits_run("ScheduledPruning 90% (cubic), sparse export", settings, callbacks=pruning,
                                       shipped=sparse_model_bytes)
    pruned.notes = f"sparsity {sparsity(pruned_model):.1%}"
    quantized, _ = _digits_run(
        "PostTrainingQuantization int8_dynamic", settings, callbacks=lambda: [PostTrainingQuantization("int8_dynamic")]
    )
    teacher.freeze()
    student = DistillationModule(
        student=digits_mlp(DIGITS_HIDDEN // 4, 2), teacher=teacher, temperature=4.0, alpha=0.9, lr=1e-2
    )
    distilled, student = _digits_run(
        f"DistillationModule 2x{DIGITS_HIDDEN // 4} student + int8", settings, model=student,
        epochs=settings.digits_epochs * 2,
    )
    from lightning_lowmem.functional.quantization import quantize_

    quantize_(student.student, "int8_dynamic")
    trainer = _trainer(max_epochs=1)
    distilled.metric = float(trainer.test(student, DigitsDataModule(batch_size=64), verbose=False)[0]["test_acc"])
    distilled.model_bytes = model_bytes(student.student)
    return [baseline, pruned, quantized, distilled]


# ----------------------------------------------------------------------------- output
def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base in (None, 0):
        return ""
    return f" ({value / base:.2f}x)"


def table(runs: list[DemoRun]) -> Any:
    from rich.table import Table

    out = Table(title="lightning_lowmem demo: baseline vs low-memory stack (ratios vs each workload's baseline)")
    for column in ("workload", "configuration", "peak train memory", "params/grads/optim/acts", "step", "model size", "metric", "notes"):
        out.add_column(
            column,
            justify="left" if column in ("workload", "configuration", "notes") else "right",
            no_wrap=column not in ("configuration", "notes"),
        )
    base: dict[str, DemoRun] = {}
    for run in runs:
        ref = base.setdefault(run.workload, run)
        parts = "/".join(
            format_bytes(run.breakdown.get(k, 0)).replace(" ", "")
            for k in ("parameters", "gradients", "optimizer_state", "activations")
        ) if run.breakdown else "-"
        out.add_row(
            run.workload,
            run.name,
            (format_bytes(run.peak_bytes) + _ratio(run.peak_bytes, ref.peak_bytes)) if run.peak_bytes else "-",
            parts,
            f"{run.step_ms:.1f} ms{_ratio(run.step_ms, ref.step_ms)}" if run.step_ms else "-",
            (format_bytes(run.model_bytes) + _ratio(run.model_bytes, ref.model_bytes)) if run.model_bytes else "-",
            f"{run.metric_name} {run.metric:.4f}" if run.metric is not None else "-",
            run.notes,
        )
    return out


def plot(runs: list[DemoRun], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [run for run in runs if run.memory_curve]
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in curves:
        steps, peaks = zip(*run.memory_curve)
        ax.plot(steps, [p / 2**20 for p in peaks], marker="o", label=f"{run.workload}: {run.name}")
    ax.set_xlabel("training step")
    ax.set_ylabel("peak memory of the step (MiB)")
    ax.set_title("Training-step peak memory over steps (memory core, sampled steps)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lowmem demo", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~1 minute version")
    parser.add_argument("--out", default="demo_output", help="folder for demo.json and the PNG")
    parser.add_argument("--workloads", nargs="*", default=["charlm", "digits"], choices=["charlm", "digits"])
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    settings = _settings(args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs: list[DemoRun] = []
    if "charlm" in args.workloads:
        runs += charlm_runs(settings)
    if "digits" in args.workloads:
        runs += digits_runs(settings)
    from rich.console import Console

    console = Console(width=200) if not Console().is_terminal else Console()
    console.print(table(runs))
    (out / "demo.json").write_text(json.dumps([run.__dict__ for run in runs], indent=2))
    png = plot(runs, out / "memory_over_steps.png")
    console.print(f"wrote {out / 'demo.json'}" + (f" and {png}" if png else "") + f" in {time.perf_counter() - started:.0f} s")
    return 0
