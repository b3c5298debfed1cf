"""Planner and estimator speed for ``bench_estimate`` (issue 18): ``plan_memory`` wall time on charlm and a
Hugging Face GPT-2 tiny config at several budgets, ``estimate_memory`` on the same tiny models, and how far
the chosen plan's per-axis prediction is from its full estimate. Times are wall clock on this machine, as
loaded as it is (the load average is recorded beside them)."""

from __future__ import annotations

import os
import statistics
import time
import warnings
from typing import Any

import torch

from benchmarks.common import mib, smoke
from lightning_lowmem.demo import CharLM
from lightning_lowmem.planning.estimate import estimate_memory
from lightning_lowmem.planning.plan import plan_memory

FRACTIONS = (0.7, 0.5, 0.3)  # budgets, as shares of the plain fp32 + AdamW estimate
PLAN_SECONDS, ESTIMATE_SECONDS, PREDICTION_ERROR = 10.0, 2.0, 0.02


def _charlm() -> tuple[torch.nn.Module, Any, str]:
    """examples/configs/charlm.yaml's model and batch: 6 x 128, batch 32 x 64 (1.26M parameters)."""
    shape = (
        dict(n_layer=2, n_head=2, n_embd=32, block_size=16)
        if smoke()
        else dict(n_layer=6, n_head=4, n_embd=128, block_size=64)
    )
    torch.manual_seed(0)
    x = torch.randint(0, 256, (4 if smoke() else 32, shape["block_size"]))
    return CharLM(**shape), (x, x.roll(-1, 1)), f"charlm {shape['n_layer']}x{shape['n_embd']}"


def _gpt2() -> tuple[torch.nn.Module, Any, str]:
    """A GPT-2 tiny config (2 x 64, byte vocabulary), batch 8 x 128 with attention mask and labels."""
    from lightning_lowmem.models.hf import HFLanguageModel

    seq = 16 if smoke() else 128
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2 if smoke() else 8, seq))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    model = HFLanguageModel("gpt2", config={"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": seq})
    return model, batch, "HF GPT-2 tiny 2x64"


def run_timings(device: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows (one per workload and budget) and the figures the targets are judged on."""
    warnings.filterwarnings("ignore")
    rows: list[dict[str, Any]] = []
    figures: dict[str, Any] = {"plan_seconds": {}, "estimate_seconds": {}, "errors": [], "load": os.getloadavg()[0]}
    for make in (_charlm, _gpt2):
        model, batch, name = make()
        times = []
        for _ in range(3):
            started = time.perf_counter()
            plain = estimate_memory(model, batch, device=device)
            times.append(time.perf_counter() - started)
        figures["estimate_seconds"][name] = statistics.median(times)
        for fraction in (0.9,) if smoke() else FRACTIONS:
            plan = plan_memory(model, batch, int(fraction * plain.peak_bytes), device=device)
            per_axis = plan.chosen.per_axis_peak_bytes or plan.predicted_peak_bytes
            error = per_axis / plan.predicted_peak_bytes - 1
            figures["errors"].append(abs(error))
            figures["plan_seconds"].setdefault(name, []).append(plan.seconds)
            rows.append(
                {
                    "workload": f"plan_memory: {name}",
                    "batch": "x".join(map(str, _shape(batch))),
                    "config": f"budget {fraction:.0%} of plain -> {plan.config.describe()}",
                    "estimated MiB": mib(plan.predicted_peak_bytes),
                    "per-axis MiB": mib(per_axis),
                    "error %": round(100 * error, 3),
                    "seconds": round(plan.seconds, 2),
                    "candidates / runs": f"{len(plan.candidates)} / {plan.notes[-2 if plan.chosen.per_axis_peak_bytes else -1]}",
                }
            )
    return rows, figures


def _shape(batch: Any) -> tuple[int, ...]:
    first = batch["input_ids"] if isinstance(batch, dict) else batch[0]
    return tuple(first.shape)


def timing_targets(figures: dict[str, Any], plan_7b: dict[str, Any] | None) -> list[dict[str, Any]]:
    load = f" (load average {figures['load']:.1f} on {os.cpu_count()} cores)"
    targets = []
    for name, seconds in figures["plan_seconds"].items():
        targets.append(
            {
                "target": f"plan_memory < {PLAN_SECONDS:.0f} s on {name.split(' ')[0] if 'charlm' in name else 'a GPT-2 tiny config'}",
                "measured": f"{name}: "
                + ", ".join(f"{s:.1f} s" for s in seconds)
                + f" at budgets {', '.join(f'{f:.0%}' for f in FRACTIONS)} of plain"
                + load,
                "met": max(seconds) < PLAN_SECONDS,
            }
        )
    estimate = figures["estimate_seconds"]
    targets.append(
        {
            "target": f"estimate_memory < {ESTIMATE_SECONDS:.0f} s on tiny models",
            "measured": ", ".join(f"{name}: {s:.2f} s" for name, s in estimate.items()) + " (median of 3)" + load,
            "met": max(estimate.values()) < ESTIMATE_SECONDS,
        }
    )
    targets.append(
        {
            "target": "the chosen plan's per-axis prediction within ±2% of its full estimate (the full one is reported)",
            "measured": f"max {100 * max(figures['errors']):.3f}% over {len(figures['errors'])} plans",
            "met": max(figures["errors"]) <= PREDICTION_ERROR,
        }
    )
    if plan_7b is not None:
        targets.append(
            {
                "target": "plan_memory < 120 s for a 7B-shaped decoder (`lowmem estimate --budget 24GiB --fine-tune`)",
                "measured": f"plan_memory {plan_7b['seconds']:.1f} s, whole command {plan_7b['wall_seconds']:.1f} s{load}",
                "met": plan_7b["seconds"] < 120,
            }
        )
    return targets
