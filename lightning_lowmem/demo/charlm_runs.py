"""The charlm rows of ``lowmem demo`` (training memory): plain fp32 AdamW vs Lightning ``bf16-true`` vs the
lowmem training stack; each row's peak memory by category, step time and validation loss."""

from __future__ import annotations

from typing import Any, Callable

import torch

from lightning_lowmem.demo.charlm import CharLM, CharLMDataModule
from lightning_lowmem.demo.rows import DemoRun, DemoSettings, demo_trainer, model_bytes
from lightning_lowmem.demo.step_profile import StepMemoryProfile
from lightning_lowmem.demo.timing import StepTimer

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
    trainer = demo_trainer(
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
