"""estimate_memory vs measure_memory on real steps, and the cost of estimating a ~1B-parameter model."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from typing import Any

import torch

from benchmarks.common import mib
from lightning_lowmem.demo import CharLM, DigitsClassifier
from lightning_lowmem.functional.optimizers import available_optimizers, build_optimizer
from lightning_lowmem.memory import measure_memory
from lightning_lowmem.memory.estimate import TrainingConfig, _apply_model_techniques, _train_step, default_loss, estimate_memory

SCALE_SCRIPT = r"""
import json, resource, time, warnings
import torch, torch.nn.functional as F
warnings.simplefilter("ignore")
from lightning_lowmem.memory.estimate import estimate_memory
from lightning_lowmem.demo.charlm import CharGPT, GPTConfig
with torch.device("meta"):
    model = CharGPT(GPTConfig(n_layer=24, n_embd=1792, n_head=16, block_size=1024))
batch = torch.empty(4, 1024, dtype=torch.long, device="meta")
start = time.perf_counter()
report = estimate_memory(model, batch, loss_fn=lambda m, b: F.cross_entropy(m(b).flatten(0, 1), b.flatten()),
                         precision="bf16-mixed", device="cuda")
print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - start,
                  "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak": report.peak_bytes}))
"""


PLAN_7B = [
    sys.executable, "-m", "lightning_lowmem.cli", "estimate", "--budget", "24GiB", "--fine-tune", "--json",
    "--model", "lightning_lowmem.demo.CharLM", "--model.n_layer", "32", "--model.n_embd", "4096",
    "--model.n_head", "32", "--model.block_size", "512", "--data", "lightning_lowmem.demo.CharLMDataModule",
    "--data.block_size", "512", "--data.batch_size", "4", "--data.max_chars", "100000",
]


def _plan_7b() -> dict[str, Any]:
    """`lowmem estimate` on a 7B-shaped decoder (32 x 4096, built on meta): the fine-tuning plan for 24 GiB."""
    out = subprocess.run(PLAN_7B, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{") :])


def _workload(name: str, batch_size: int, device: str) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    if name == "charlm":
        x = torch.randint(0, 256, (batch_size, 64), device=device)
        return CharLM(n_layer=4, n_head=4, n_embd=128, block_size=64), (x, x.roll(-1, 1))
    images = torch.rand(batch_size, 1, 8, 8, device=device)
    return DigitsClassifier(arch="cnn", hidden=32), (images, torch.randint(0, 10, (batch_size,), device=device))


def _measure(name: str, batch_size: int, config: TrainingConfig, device: str) -> int:
    model, batch = _workload(name, batch_size, device)
    model = model.to(device)
    dtype = {"bf16-true": torch.bfloat16}.get(config.precision)
    if dtype is not None:
        model = model.to(dtype)
        batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)
    autocast = {"bf16-mixed": torch.bfloat16}.get(config.precision)
    _apply_model_techniques(model, config)
    optimizer = build_optimizer(config.optimizer, [p for p in model.parameters() if p.requires_grad])
    _train_step(model, batch, default_loss, optimizer, config, autocast)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _train_step(model, batch, default_loss, optimizer, config, autocast)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return measure_memory(_train_step, model, batch, default_loss, optimizer, config, autocast, module=model).peak_bytes


def _configs() -> list[tuple[str, int, TrainingConfig]]:
    configs = [
        ("charlm", 16, TrainingConfig()),
        ("charlm", 32, TrainingConfig()),
        ("charlm", 16, TrainingConfig(precision="bf16-true")),
        ("charlm", 16, TrainingConfig(precision="bf16-mixed")),
        ("charlm", 32, TrainingConfig(micro_batch_size=8)),
        ("digits", 64, TrainingConfig()),
        ("digits", 256, TrainingConfig(precision="bf16-true")),
    ]
    try:
        import lightning_lowmem.functional.checkpointing  # noqa: F401

        configs += [("charlm", 16, TrainingConfig(activation_checkpointing="auto")), ("charlm", 32, TrainingConfig(precision="bf16-true", activation_checkpointing="auto"))]
    except ImportError:
        pass
    if "adafactor" in available_optimizers():
        configs += [("charlm", 16, TrainingConfig(optimizer="adafactor")), ("digits", 64, TrainingConfig(optimizer="adafactor"))]
    return configs


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    rows, errors = [], []
    configs = _configs()[:3] if quick else _configs()
    for name, batch_size, config in configs:
        model, batch = _workload(name, batch_size, "cpu")
        estimate = estimate_memory(model, batch, device=device, config=config)
        measured = _measure(name, batch_size, config, device)
        predicted = estimate.peak_bytes + (estimate.overheads.get("cublas_workspace", 0) if device == "cuda" else 0)
        error = predicted / measured - 1
        errors.append(abs(error))
        rows.append(
            {
                "workload": name,
                "batch": batch_size,
                "config": config.describe(),
                "estimated MiB": mib(predicted),
                "measured MiB": mib(measured),
                "error %": round(100 * error, 2),
            }
        )
    scale = json.loads(subprocess.run([sys.executable, "-c", SCALE_SCRIPT], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    plan = _plan_7b() if not quick else None
    limit = 0.05 if device == "cpu" else 0.10
    return {
        "title": f"estimate_memory vs measured peak ({device})",
        "rows": rows,
        "targets": [
            {
                "target": f"estimate within {limit:.0%} of the measured peak on every configuration",
                "measured": f"max abs error {100 * max(errors):.2f}% over {len(errors)} configurations",
                "met": max(errors) <= limit,
            },
            {
                "target": "estimating a ~1B-parameter transformer step: < 60 s and < 2 GiB RSS",
                "measured": f"{scale['params'] / 1e9:.2f}B params: {scale['seconds']:.1f} s, max RSS "
                f"{scale['max_rss'] / 2**30:.2f} GiB (predicted CUDA peak {scale['peak'] / 2**30:.1f} GiB, bf16-mixed, batch 4x1024)",
                "met": scale["seconds"] < 60 and scale["max_rss"] < 2 * 2**30,
            },
        ]
        + (
            [
                {
                    "target": "`lowmem estimate` finds a plan fitting 24 GiB for fine-tuning a 7B-shaped decoder",
                    "measured": f"chosen [{plan['chosen']['label']}] predicted {plan['chosen']['predicted_peak_bytes'] / 2**30:.2f} GiB; "
                    f"full fine-tune [{plan['baseline']['label']}] predicted {plan['baseline']['predicted_peak_bytes'] / 2**30:.2f} GiB",
                    "met": bool(plan["chosen"]["fits"]),
                }
            ]
            if plan
            else []
        ),
        "notes": "Measured = the memory core's tracker on CPU, torch.cuda.max_memory_allocated on CUDA (estimate + "
        "cuBLAS workspace compared). Each row runs the same step function for real and on fake tensors.",
    }
