"""AutoMicrobatch on charlm through Lightning: what surviving an out-of-memory error costs.

Three runs of the same CharLM (6 blocks x 128, fp32 AdamW, batch 32 x 64) from the same weights on the
same batches, each through ``Trainer.fit`` with ``MemoryMonitor`` measuring a deep breakdown every step:

* plain: whole batches of 32 (the anchor);
* AutoMicrobatch: the model raises ``torch.OutOfMemoryError`` for any batch above 8 rows (an injected
  memory limit); the callback retries the first batch in micro-batches of 16, then 8, and keeps 8;
* accumulate-by-4: Lightning's own ``accumulate_grad_batches=4`` on batches of 8 (what a user would set
  by hand), for the step time.

Reported: peak memory (memory core), median step time after warm-up, the one-time cost of the step that
hit the OOM, the micro-batch size found, and the largest weight difference to the plain run after the
same number of optimizer steps as Lightning's accumulate-by-4 run (the issue's reference; the plain run's
difference to it is float summation order, amplified by Adam's first steps).

On CUDA the out-of-memory error is real: the process is capped with
``torch.cuda.set_per_process_memory_fraction`` halfway between the memory a step in micro-batches of 8
reserves and what one in micro-batches of 16 reserves (both measured first), on a charlm large enough
(6 x 512, batch 32 x 256) that activations decide. The accumulation run then uses the micro-batch size
AutoMicrobatch found. Attention runs on SDPA's math kernel there, whose backward is deterministic, so
equal weights mean equal arithmetic.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from typing import Any

import lightning as L
import torch

from benchmarks.common import StepTimer, mib, quiet_trainer, smoke
from lightning_lowmem.callbacks.auto_microbatch import AutoMicrobatch
from lightning_lowmem.callbacks.memory_monitor import MemoryMonitor
from lightning_lowmem.demo.charlm import CharLM, CharLMDataModule

BATCH, LIMIT, BLOCK = 32, 8, 64
CUDA_MODEL = dict(n_layer=6, n_head=8, n_embd=512, block_size=256)  # activations dominate at batch 32 x 256


class _LimitedCharLM(CharLM):
    """CharLM that runs out of memory (``torch.OutOfMemoryError``) on batches of more than ``limit`` rows."""

    def __init__(self, *args: Any, limit: int = LIMIT, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit = limit

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch[0].shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"injected: {batch[0].shape[0]} rows > {self.limit}")
        return super().training_step(batch, batch_idx)


class _FirstStepTimer(L.Callback):
    """Wall time of the first training batch (the one that runs out of memory and is retried)."""

    def __init__(self) -> None:
        self.seconds = float("nan")
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 0 and trainer.fit_loop.epoch_loop.batch_progress.current.ready == 1:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.current.ready == 1:
            self.seconds = time.perf_counter() - self._start


def _fit(
    model: L.LightningModule,
    batch_size: int,
    steps: int,
    callbacks: list[Any],
    device: str = "cpu",
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    monitor, timer, first = (
        MemoryMonitor(deep_every_n_steps=1, summary=False),
        StepTimer(skip_first=2),
        _FirstStepTimer(),
    )
    data = CharLMDataModule(block_size=model.hparams.block_size, batch_size=batch_size, max_chars=400_000)
    torch.manual_seed(0)
    trainer = quiet_trainer(
        max_steps=steps,
        limit_val_batches=0,
        callbacks=[monitor, timer, first, *callbacks],
        accelerator=device,
        **trainer_kwargs,
    )
    with _deterministic_attention(device):
        trainer.fit(model, data)
    model.cpu()  # the next run starts from an empty device
    peaks = [int(row["peak"]) for row in monitor.history if "peak" in row]
    per_step = trainer_kwargs.get("accumulate_grad_batches", 1)  # StepTimer times batches, not optimizer steps
    return {
        "peak_MiB": mib(max(peaks)),
        "step_ms": round(1000 * per_step * timer.median_s, 1),
        "first_step_ms": round(1000 * first.seconds, 1),
        "optimizer_steps": trainer.global_step,
    }


def _deterministic_attention(device: str) -> Any:
    """On CUDA, SDPA's math kernel (deterministic backward); elsewhere nothing changes."""
    if device != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _reserved_peak(base: CharLM, micro: int, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """CUDA bytes the caching allocator reserves for a second training step of ``base`` (AdamW, state
    created by the first) run as micro-batches of ``micro`` rows: what a memory cap is compared with."""
    model = copy.deepcopy(base).cuda()
    optimizer = model.configure_optimizers()
    x, y = (t.cuda() for t in batch)
    for step in range(2):
        if step == 1:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with _deterministic_attention("cuda"):
            for start in range(0, len(x), micro):
                (model._loss((x[start : start + micro], y[start : start + micro])) * micro / len(x)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    reserved = torch.cuda.max_memory_reserved()
    del model, optimizer, x, y
    gc.collect()
    torch.cuda.empty_cache()
    return reserved


def _cuda_cap(base: CharLM) -> dict[str, Any]:
    """The memory fraction that makes micro-batches of 16 run out of memory and micro-batches of 8 fit."""
    data = CharLMDataModule(block_size=base.hparams.block_size, batch_size=BATCH, max_chars=400_000)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    reserved = {micro: _reserved_peak(base, micro, batch) for micro in (BATCH, BATCH // 2, BATCH // 4)}
    baseline = torch.cuda.memory_reserved()  # the process's own reservations outside the step (none expected)
    cap = baseline + (reserved[BATCH // 4] + reserved[BATCH // 2]) // 2
    total = torch.cuda.get_device_properties(0).total_memory
    return {"reserved": reserved, "cap": cap, "fraction": cap / total}


def _fit_capped(model: CharLM, steps: int, callback: AutoMicrobatch, fraction: float) -> dict[str, Any]:
    """``_fit`` on CUDA with the process capped at ``fraction`` of the device: real OOMs, nothing injected."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        return _fit(model, BATCH, steps, [callback], device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    if device == "cuda":
        return _run_cuda(quick)
    steps = 2 if smoke() else 4 if quick else 12
    torch.manual_seed(0)
    n_head, n_embd = (2, 32) if smoke() else (4, 128)
    base = CharLM(n_layer=1 if smoke() else 2 if quick else 6, n_head=n_head, n_embd=n_embd, block_size=BLOCK)
    plain_model = copy.deepcopy(base)
    limited = _LimitedCharLM(n_layer=base.hparams.n_layer, n_head=n_head, n_embd=n_embd, block_size=BLOCK)
    limited.load_state_dict(base.state_dict())
    accumulate_model = copy.deepcopy(base)
    callback = AutoMicrobatch()

    plain = _fit(plain_model, BATCH, steps, [])
    auto = _fit(limited, BATCH, steps, [callback])
    # accumulate_grad_batches counts batches, not optimizer steps: max_steps is in optimizer steps
    accumulate = _fit(accumulate_model, BATCH // 4, steps, [], accumulate_grad_batches=4)
    accumulate.pop("first_step_ms")  # its first batch is one micro-batch: not comparable
    diff, diff_plain = _max_diff(limited, accumulate_model), _max_diff(plain_model, accumulate_model)
    rows = [
        {
            "setup": "plain, whole batches of 32 (anchor)",
            **plain,
            "micro_batch": BATCH,
            "weights_vs_accumulate": float(f"{diff_plain:.3g}"),
        },
        {
            "setup": f"AutoMicrobatch, OOM injected above {LIMIT} rows",
            **auto,
            "micro_batch": callback.micro_batch_size,
            "weights_vs_accumulate": float(f"{diff:.3g}"),
        },
        {
            "setup": "Lightning accumulate_grad_batches=4 on batches of 8 (by hand)",
            **accumulate,
            "micro_batch": BATCH // 4,
            "weights_vs_accumulate": 0.0,
        },
    ]
    for row in rows:
        row["peak_vs_plain"] = round(row["peak_MiB"] / plain["peak_MiB"], 3)
        row["step_vs_plain"] = round(row["step_ms"] / plain["step_ms"], 2)
    step_vs_manual = auto["step_ms"] / accumulate["step_ms"]
    targets = [
        {
            "target": f"training on batch {BATCH} completes with an OOM injected above {LIMIT}",
            "measured": f"micro-batch {callback.micro_batch_size}, {steps} optimizer steps",
            "met": callback.micro_batch_size == LIMIT,
        },
        {
            "target": "final weights equal an accumulate-by-4 run's without OOM (fp tolerance 1e-6)",
            "measured": f"max |diff| {diff:.2e}",
            "met": diff <= 1e-6,
        },
    ]
    notes = (
        f"CharLM {base.hparams.n_layer}x{n_embd}, fp32 AdamW (lr {base.hparams.lr}), batch {BATCH}x{BLOCK}, {steps} optimizer "
        "steps from the same weights on the same batches, through Trainer.fit; peak = MemoryMonitor deep breakdown "
        "(memory core) of every step, max over steps; step_ms = median wall time per optimizer step after 2 warm-up "
        f"steps; weights_vs_accumulate = largest weight difference to the accumulate-by-4 run; first_step_ms = the first batch (for AutoMicrobatch: the OOM at 32, the retry at 16, the OOM and the "
        f"retry at 8). AutoMicrobatch's steady step costs {step_vs_manual:.2f}x the hand-written accumulate-by-4 run "
        "(same micro-batches; its loss returned to Lightning is detached, so Lightning's own backward is free)."
    )
    return {
        "title": "AutoMicrobatch on charlm (injected out-of-memory error, Lightning)",
        "rows": rows,
        "targets": targets,
        "notes": notes,
    }


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _run_cuda(quick: bool) -> dict[str, Any]:
    """Plain batches of 32; AutoMicrobatch under a real memory cap; accumulation at the size it found."""
    steps = 4 if quick else 12
    torch.manual_seed(0)
    base = CharLM(**CUDA_MODEL)
    plain_model, auto_model, accumulate_model = (copy.deepcopy(base) for _ in range(3))
    cap = _cuda_cap(base)
    plain = _fit(plain_model, BATCH, steps, [], device="cuda")
    callback = AutoMicrobatch()
    auto = _fit_capped(auto_model, steps, callback, cap["fraction"])
    micro = callback.micro_batch_size or BATCH
    accumulate = _fit(accumulate_model, micro, steps, [], device="cuda", accumulate_grad_batches=BATCH // micro)
    accumulate.pop("first_step_ms")  # its first batch is one micro-batch: not comparable
    diff, diff_plain = _max_diff(auto_model, accumulate_model), _max_diff(plain_model, accumulate_model)
    reserved = {size: mib(value) for size, value in cap["reserved"].items()}
    rows = [
        {
            "setup": f"plain, whole batches of {BATCH} (anchor)",
            **plain,
            "micro_batch": BATCH,
            "weights_vs_accumulate": float(f"{diff_plain:.3g}"),
        },
        {
            "setup": f"AutoMicrobatch, process capped at {mib(cap['cap'])} MiB (real CUDA OOM)",
            **auto,
            "micro_batch": callback.micro_batch_size,
            "weights_vs_accumulate": float(f"{diff:.3g}"),
        },
        {
            "setup": f"Lightning accumulate_grad_batches={BATCH // micro} on batches of {micro} (by hand)",
            **accumulate,
            "micro_batch": micro,
            "weights_vs_accumulate": 0.0,
        },
    ]
    for row in rows:
        row["peak_vs_plain"] = round(row["peak_MiB"] / plain["peak_MiB"], 3)
        row["step_vs_plain"] = round(row["step_ms"] / plain["step_ms"], 2)
    completed = (
        callback.micro_batch_size is not None and callback.micro_batch_size < BATCH and auto["optimizer_steps"] == steps
    )
    targets = [
        {
            "target": f"training on batch {BATCH} completes after a real CUDA out-of-memory error (memory fraction cap)",
            "measured": f"cap {mib(cap['cap'])} MiB ({100 * cap['fraction']:.2f}% of the GPU); micro-batch "
            f"{callback.micro_batch_size}, {auto['optimizer_steps']} of {steps} optimizer steps",
            "met": completed,
            "twin": f"training on batch {BATCH} completes with an OOM injected above {LIMIT}",
        },
        {
            "target": f"final weights equal an accumulate-by-{BATCH // micro} run's without OOM (fp tolerance 1e-6)",
            "measured": f"max |diff| {diff:.2e}",
            "met": diff <= 1e-6,
            "twin": "final weights equal an accumulate-by-4 run's without OOM (fp tolerance 1e-6)",
        },
    ]
    notes = (
        f"CharLM {CUDA_MODEL['n_layer']}x{CUDA_MODEL['n_embd']} (block {CUDA_MODEL['block_size']}), fp32 AdamW, batch "
        f"{BATCH}x{CUDA_MODEL['block_size']}, {steps} optimizer steps from the same weights on the same batches, through "
        f"Trainer.fit on CUDA, SDPA math attention. Reserved by a second step (plain loop) in micro-batches of 32 / 16 / 8: "
        f"{reserved[BATCH]} / {reserved[BATCH // 2]} / {reserved[BATCH // 4]} MiB; the AutoMicrobatch run is capped with "
        "torch.cuda.set_per_process_memory_fraction halfway between the last two, so its first batch runs out of "
        "memory for real. peak = MemoryMonitor's deep breakdown (memory core), max over steps; step_ms = median wall "
        "time per optimizer step after 2 warm-up steps; first_step_ms includes the OOM(s) and retries."
    )
    return {
        "title": "AutoMicrobatch on charlm (real CUDA out-of-memory error, Lightning)",
        "rows": rows,
        "targets": targets,
        "notes": notes,
    }
