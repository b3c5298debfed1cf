"""LowMemoryStrategy on charlm: a memory_budget plan vs the plain run, ZeRO-1 optimizer state per rank,
and DDP gradient bytes with and without ``gradient_as_bucket_view``."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.common import mib, quiet_trainer, set_seed
from lightning_lowmem.demo import CharLM, CharLMDataModule
from lightning_lowmem.memory import state_bytes, track_memory
from lightning_lowmem.strategies.low_memory import LowMemoryDDPStrategy, LowMemoryStrategy

MODEL = dict(n_layer=2, n_head=2, n_embd=64, block_size=32)
BUDGET = "4MiB"
MICRO_BUDGET = "2.5MiB"  # below every whole-batch mix with AdamW: the plan must use micro-batches


def _data(batch_size: int = 16) -> CharLMDataModule:
    return CharLMDataModule(block_size=32, batch_size=batch_size, max_chars=200_000)


class _TrackTraining(L.Callback):
    """The memory core's tracker from the first to the last training step (after setup and planning)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._context = track_memory(pl_module, device=trainer.strategy.root_device.type)
        self.tracking = self._context.__enter__()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._context.__exit__(None, None, None)
        self.peak_bytes = self.tracking.report.peak_bytes  # type: ignore[union-attr]


class _Save(L.Callback):
    """Each rank writes its optimizer-state bytes and gradient / bucket storage bytes to ``directory``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.figures: dict[str, int] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.figures:
            return
        grads = {
            p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
            for p in pl_module.parameters()
            if p.grad is not None
        }
        self.figures = {
            "parameter_bytes": state_bytes(pl_module)["parameters"],
            "gradient_and_bucket_bytes": sum({**grads, **self.buckets}.values()),
        }

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.buckets: dict[int, int] = {}  # DDP bucket storages: data pointer -> bytes
        model = trainer.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            def hook(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
                storage = bucket.buffer().untyped_storage()
                self.buckets[storage.data_ptr()] = storage.nbytes()
                return default_hooks.allreduce_hook(state, bucket)

            model.register_comm_hook(None, hook)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.figures["optimizer_state_bytes"] = state_bytes(optimizers=trainer.optimizers)["optimizer_state"]
        torch.save(self.figures, f"{self.directory}/rank{trainer.global_rank}.pt")


def _budget_rows(steps: int) -> list[dict[str, Any]]:
    rows = []
    for budget in (None, BUDGET, MICRO_BUDGET):
        set_seed(0)
        tracker = _TrackTraining()
        strategy = LowMemoryStrategy(memory_budget=budget, optimizer="adamw")
        trainer = quiet_trainer(strategy=strategy, max_steps=steps, limit_val_batches=0, callbacks=[tracker])
        trainer.fit(CharLM(**MODEL), _data())
        plan = strategy.plan
        rows.append(
            {
                "run": "plain" if budget is None else f"memory_budget={budget}",
                "config": plan.config.describe() if plan else "32-true + adamw",
                "predicted_peak_mib": mib(plan.predicted_peak_bytes) if plan else None,
                "measured_peak_mib": mib(tracker.peak_bytes),
            }
        )
    return rows


def _ddp_figures(directory: Path, devices: int, steps: int, **strategy_kwargs: Any) -> list[dict[str, int]]:
    set_seed(0)
    strategy = (
        LowMemoryDDPStrategy(start_method="spawn", **strategy_kwargs)
        if devices > 1
        else LowMemoryDDPStrategy(**strategy_kwargs)
    )
    trainer = quiet_trainer(
        devices=devices, strategy=strategy, max_steps=steps, limit_val_batches=0, callbacks=[_Save(str(directory))]
    )
    trainer.fit(CharLM(**MODEL), _data(16 // devices))
    return [torch.load(directory / f"rank{rank}.pt") for rank in range(devices)]


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    if device != "cpu":
        raise ValueError("bench_strategy runs on CPU (2-process DDP uses gloo)")
    steps = 3 if quick else 20
    rows = _budget_rows(steps)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in ("one", "view", "copy", "zero"):
            (root / name).mkdir()
        # the 2-process run first: the in-process runs below keep their process group (and its port)
        zero = _ddp_figures(root / "zero", 2, steps, zero_optimizer=True)
        unsharded = _ddp_figures(root / "one", 1, steps)[0]
        view = _ddp_figures(root / "view", 1, steps)[0]
        copy = _ddp_figures(root / "copy", 1, steps, gradient_as_bucket_view=False)[0]
    params = view["parameter_bytes"]
    rows += [
        {
            "run": "lowmem_ddp, 1 process",
            "config": "gradient_as_bucket_view=True",
            "gradient_and_bucket_mib": mib(view["gradient_and_bucket_bytes"]),
            "parameter_mib": mib(params),
        },
        {
            "run": "lowmem_ddp, 1 process",
            "config": "gradient_as_bucket_view=False",
            "gradient_and_bucket_mib": mib(copy["gradient_and_bucket_bytes"]),
            "parameter_mib": mib(params),
        },
        {
            "run": "lowmem_ddp, 1 process",
            "config": "AdamW (unsharded)",
            "optimizer_state_mib": mib(unsharded["optimizer_state_bytes"]),
        },
    ] + [
        {
            "run": f"lowmem_ddp, 2 processes, rank {rank}",
            "config": "zero_optimizer=True",
            "optimizer_state_mib": mib(figures["optimizer_state_bytes"]),
        }
        for rank, figures in enumerate(zero)
    ]
    budget_bytes = 4 * 2**20
    largest_shard = max(f["optimizer_state_bytes"] for f in zero) / unsharded["optimizer_state_bytes"]
    targets = [
        {
            "target": f"memory_budget={BUDGET}: measured training peak <= budget",
            "measured": f"{rows[1]['measured_peak_mib']} MiB with [{rows[1]['config']}] (plain: {rows[0]['measured_peak_mib']} MiB)",
            "met": rows[1]["measured_peak_mib"] <= mib(budget_bytes),
        },
        {
            "target": f"memory_budget={MICRO_BUDGET} (no whole-batch mix fits): micro-batches (AutoMicrobatch), peak <= budget",
            "measured": f"{rows[2]['measured_peak_mib']} MiB with [{rows[2]['config']}]",
            "met": rows[2]["measured_peak_mib"] <= mib(2.5 * 2**20) and "mb " in rows[2]["config"],
        },
        {
            "target": "ZeRO-1 on 2 processes: each rank holds <= 55% of the unsharded optimizer state",
            "measured": f"largest shard {largest_shard:.1%}",
            "met": largest_shard <= 0.55,
        },
        {
            "target": "gradient_as_bucket_view: gradients + DDP buckets = 1x parameter bytes (not 2x)",
            "measured": f"{view['gradient_and_bucket_bytes'] / params:.2f}x (off: {copy['gradient_and_bucket_bytes'] / params:.2f}x)",
            "met": view["gradient_and_bucket_bytes"] == params,
        },
    ]
    return {
        "title": f"LowMemoryStrategy on charlm ({MODEL['n_layer']} x {MODEL['n_embd']}, batch 16 x 32), {steps} steps, CPU",
        "rows": rows,
        "targets": targets,
        "notes": "Peaks: the memory core's tracker from the first to the last training step (CPU). The planner's "
        "optimizer axis is fixed to adamw. ZeRO shards are ZeroRedundancyOptimizer's greedy partition by parameter "
        "size, so they are near, not exactly, half. Gradient and bucket bytes count each storage once.",
    }
