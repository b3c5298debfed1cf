"""The digits rows of ``lowmem demo`` (shipping size / accuracy): a float MLP vs pruning, int8 PTQ and a
distilled int8 student; each row's test accuracy and the bytes of the file you would ship."""

from __future__ import annotations

from typing import Any, Callable

import lightning as L
import torch

from lightning_lowmem.demo.digits import DigitsClassifier, DigitsDataModule
from lightning_lowmem.demo.rows import DemoRun, DemoSettings, demo_trainer, model_bytes
from lightning_lowmem.demo.step_profile import StepMemoryProfile
from lightning_lowmem.demo.timing import StepTimer

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
    trainer = demo_trainer(
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
