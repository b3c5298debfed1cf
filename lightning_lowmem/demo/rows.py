"""One row of ``lowmem demo``: what it runs (:class:`DemoSettings`, :func:`settings_for`), what it measured
(:class:`DemoRun`), the quiet CPU Trainer every row trains with and the bytes of the model it would ship."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch

from lightning_lowmem.demo.timing import StepProgress, bf16_speed


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


def demo_trainer(
    title: str, max_steps: int = -1, max_epochs: int | None = None, callbacks: list[Any] = (), **kwargs: Any
) -> L.Trainer:
    """The CPU Trainer of one demo row: a step-counted progress bar titled ``title``, no logger, no checkpoints."""
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
