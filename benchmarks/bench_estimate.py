"""estimate_memory vs measured peaks on real steps, the cost of estimating a ~1B-parameter model, and
(on CUDA) the moonshot check: a >= 1B-parameter decoder step estimated first, then run.

On CPU the measured side is the memory core's tracker; on CUDA it is ``torch.cuda.max_memory_allocated``
(the allocator's own count: block rounding, cuBLAS workspaces and all), each configuration measured from
a clean slate (earlier tensors freed, cuBLAS workspaces released) on its second step, when optimizer state
exists. The estimate compared is ``estimate.peak_bytes + report.overheads["cublas_workspace"]``.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import subprocess
import sys
import time
import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from benchmarks._plan_timing import run_timings, timing_targets
from benchmarks.common import CudaPeak, clear_cuda_workspaces, mib, smoke
from lightning_lowmem.demo import CharLM, DigitsClassifier
from lightning_lowmem.functional.optimizers.catalog import available_optimizers, build_optimizer
from lightning_lowmem.memory import measure_memory, state_bytes
from lightning_lowmem.planning.estimate import (
    TrainingConfig,
    _apply_model_techniques,
    _train_step,
    default_loss,
    estimate_memory,
)

LOOP = "lightning"
"""The measured step runs in Lightning's order (zero_grad between training_step and backward: the previous
step's gradients are alive through the forward), as ``estimate_memory`` estimates a LightningModule."""

SCALE_SCRIPT = r"""
import json, resource, sys, time, warnings
import torch, torch.nn.functional as F
warnings.simplefilter("ignore")
from lightning_lowmem.planning.estimate import estimate_memory
from lightning_lowmem.demo.charlm import CharGPT, GPTConfig
n_layer, n_embd, block = (int(a) for a in sys.argv[1:4])
with torch.device("meta"):
    model = CharGPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=16, block_size=block))
batch = torch.empty(4, block, dtype=torch.long, device="meta")
start = time.perf_counter()
report = estimate_memory(model, batch, loss_fn=lambda m, b: F.cross_entropy(m(b).flatten(0, 1), b.flatten()),
                         precision="bf16-mixed", device="cuda")
print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - start,
                  "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak": report.peak_bytes}))
"""
SCALE_SHAPE = ("24", "1792", "1024")  # 0.93B parameters, batch 4 x 1024
SMOKE_SCALE_SHAPE = ("1", "64", "16")

# The moonshot: a >= 1B-parameter decoder (CharGPT 24 x 2048, 1.21B parameters), bf16-mixed AdamW, batch 4 x 512
MOONSHOT = dict(n_layer=24, n_head=16, n_embd=2048, block_size=512)
MOONSHOT_BATCH = 4
SMOKE_MOONSHOT = dict(n_layer=2, n_head=2, n_embd=64, block_size=32)

PLAN_7B = [
    sys.executable,
    "-m",
    "lightning_lowmem.cli",
    "estimate",
    "--budget",
    "24GiB",
    "--fine-tune",
    "--json",
    "--model",
    "lightning_lowmem.demo.CharLM",
    "--model.n_layer",
    "32",
    "--model.n_embd",
    "4096",
    "--model.n_head",
    "32",
    "--model.block_size",
    "512",
    "--data",
    "lightning_lowmem.demo.CharLMDataModule",
    "--data.block_size",
    "512",
    "--data.batch_size",
    "4",
    "--data.max_chars",
    "100000",
]


def _scale(shape: tuple[str, str, str]) -> dict[str, Any]:
    """SCALE_SCRIPT's figures: in a fresh process (its max RSS is the estimate's), or in a smoke run in this one
    (the same code; a fresh interpreter's imports would be a fifth of the dry run's time)."""
    if not smoke():
        out = subprocess.run(
            [sys.executable, "-c", SCALE_SCRIPT, *shape], capture_output=True, text=True, check=True
        ).stdout
        return json.loads(out.strip().splitlines()[-1])
    stdout, argv = io.StringIO(), sys.argv
    try:
        sys.argv = ["-c", *shape]
        with contextlib.redirect_stdout(stdout):
            exec(compile(SCALE_SCRIPT, "<SCALE_SCRIPT>", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = argv
    return json.loads(stdout.getvalue().strip().splitlines()[-1])


def _plan_7b() -> dict[str, Any]:
    """`lowmem estimate` on a 7B-shaped decoder (32 x 4096, built on meta): the fine-tuning plan for 24 GiB."""
    started = time.perf_counter()
    out = subprocess.run(PLAN_7B, capture_output=True, text=True, check=True).stdout
    return {**json.loads(out[out.index("{") :]), "wall_seconds": time.perf_counter() - started}


# workload sizes: CPU (the memory core measures exactly, small is enough), CUDA (large enough that fixed
# allocator overheads do not decide the error), smoke (the dry run: code paths only)
SIZES: dict[str, dict[str, Any]] = {
    "cpu": {
        "charlm": dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
        "gpt2": dict(n_layer=2, n_embd=64, n_head=4),
        "seq": 64,
    },
    "cuda": {
        "charlm": dict(n_layer=8, n_head=8, n_embd=512, block_size=256),
        "gpt2": dict(n_layer=6, n_embd=512, n_head=8),
        "seq": 256,
    },
    "smoke": {
        "charlm": dict(n_layer=1, n_head=2, n_embd=32, block_size=16),
        "gpt2": dict(n_layer=1, n_embd=32, n_head=2),
        "seq": 16,
    },
}


def _size(device: str) -> dict[str, Any]:
    return SIZES["smoke" if smoke() else device]


def _workload(name: str, batch_size: int, device: str, size: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    if name == "charlm":
        x = torch.randint(0, 256, (batch_size, size["charlm"]["block_size"]), device=device)
        return CharLM(**size["charlm"]), (x, x.roll(-1, 1))
    if name == "gpt2":
        from lightning_lowmem.models.hf import HFLanguageModel

        ids = torch.randint(0, 256, (batch_size, size["seq"]), device=device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        return HFLanguageModel("gpt2", config={**size["gpt2"], "n_positions": size["seq"]}), batch
    images = torch.rand(batch_size, 1, 8, 8, device=device)
    return DigitsClassifier(arch="cnn", hidden=32), (images, torch.randint(0, 10, (batch_size,), device=device))


def _cast_batch(batch: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return batch
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch)


def _measure(name: str, batch_size: int, config: TrainingConfig, device: str, size: dict[str, Any]) -> dict[str, int]:
    """The real step's peak: memory core on CPU, the CUDA caching allocator's count on CUDA."""
    model, batch = _workload(name, batch_size, device, size)
    model = model.to(device)
    dtype = {"bf16-true": torch.bfloat16}.get(config.precision_preset)
    if dtype is not None:
        model = model.to(dtype)
    batch = _cast_batch(batch, dtype)
    autocast_dtype = {"bf16-mixed": torch.bfloat16}.get(config.precision_preset)
    _apply_model_techniques(model, config)
    optimizer = build_optimizer(config.optimizer.name, [p for p in model.parameters() if p.requires_grad])
    if device != "cuda":
        _train_step(model, batch, default_loss, optimizer, config, autocast_dtype, loop=LOOP)
        report = measure_memory(
            _train_step,
            model,
            batch,
            default_loss,
            optimizer,
            config,
            autocast_dtype,
            loop=LOOP,
            module=model,
            device=device,
        )
        return {"peak": report.peak_bytes}
    # _train_step's autocast is CPU autocast (the estimator's stand-in): on CUDA autocast the CUDA ops, without the
    # weight cache as Lightning's MixedPrecision plugin runs it (the estimate's default)
    autocast = (
        torch.autocast("cuda", dtype=autocast_dtype, cache_enabled=False)
        if autocast_dtype
        else contextlib.nullcontext()
    )
    with autocast:
        _train_step(model, batch, default_loss, optimizer, config, None, loop=LOOP)  # creates the optimizer state
    with CudaPeak() as peak, autocast:
        _train_step(model, batch, default_loss, optimizer, config, None, loop=LOOP)
    # allocated after the step beyond the model, its optimizer state and the batch: cuBLAS workspaces and the like
    tensors = sum(state_bytes(model, [optimizer]).values()) + sum(
        t.untyped_storage().nbytes() for t in tree_leaves(batch) if isinstance(t, torch.Tensor)
    )
    del model, optimizer, batch
    return {"peak": peak.peak, "persistent": peak.after - tensors}


def _cuda_release() -> None:
    """Start the next configuration from an empty device: no tensors of the last one, no cuBLAS workspace."""
    gc.collect()
    torch.cuda.synchronize()
    clear_cuda_workspaces()
    torch.cuda.empty_cache()


def _configs(device: str, quick: bool) -> list[tuple[str, int, TrainingConfig]]:
    if device == "cuda":
        # the set: charlm and an HF GPT-2 config; fp32, bf16-true, checkpointing, compression, 8-bit AdamW
        configs = [
            ("charlm", 16, TrainingConfig()),
            ("charlm", 16, TrainingConfig(precision="bf16-true")),
            ("charlm", 16, TrainingConfig(activation_checkpointing="auto")),
            ("charlm", 16, TrainingConfig(activation_compression="int8")),
            ("charlm", 16, TrainingConfig(optimizer="adamw8bit")),
            ("gpt2", 8, TrainingConfig()),
            ("gpt2", 8, TrainingConfig(precision="bf16-true", activation_checkpointing="auto")),
        ]
        if not quick:
            configs += [
                ("charlm", 16, TrainingConfig(precision="bf16-mixed")),
                ("charlm", 32, TrainingConfig(micro_batch_size=8)),
                ("charlm", 16, TrainingConfig(optimizer="adafactor")),
                (
                    "gpt2",
                    8,
                    TrainingConfig(precision="bf16-true", activation_compression="int8", optimizer="adamw8bit"),
                ),
            ]
        return configs
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

        configs += [
            ("charlm", 16, TrainingConfig(activation_checkpointing="auto")),
            ("charlm", 32, TrainingConfig(precision="bf16-true", activation_checkpointing="auto")),
        ]
    except ImportError:
        pass
    if "adafactor" in available_optimizers():
        configs += [
            ("charlm", 16, TrainingConfig(optimizer="adafactor")),
            ("digits", 64, TrainingConfig(optimizer="adafactor")),
        ]
    if smoke():  # the dry run also runs the CUDA set's workloads and techniques, on CPU
        return [configs[0], ("gpt2", 2, TrainingConfig()), ("charlm", 2, TrainingConfig(activation_compression="int8"))]
    return configs[:3] if quick else configs


def _describe(name: str, size: dict[str, Any]) -> str:
    if name == "charlm":
        return f"charlm {size['charlm']['n_layer']}x{size['charlm']['n_embd']}"
    if name == "gpt2":
        return f"HF GPT-2 {size['gpt2']['n_layer']}x{size['gpt2']['n_embd']}"
    return name


def _compare(device: str, quick: bool) -> tuple[list[dict[str, Any]], list[float]]:
    rows, errors = [], []
    size = _size(device)
    for name, batch_size, config in _configs(device, quick):
        model, batch = _workload(name, batch_size, "cpu", size)
        estimate = estimate_memory(model, batch, device=device, config=config)
        del model, batch
        if device == "cuda":
            _cuda_release()
        measured = _measure(name, batch_size, config, device, size)
        predicted = estimate.peak_bytes + (estimate.overheads.get("cublas_workspace", 0) if device == "cuda" else 0)
        error = predicted / measured["peak"] - 1
        errors.append(abs(error))
        row = {
            "workload": _describe(name, size),
            "batch": f"{batch_size}x{size['seq'] if name != 'digits' else '1x8x8'}",
            "config": config.describe(),
            "estimated MiB": mib(predicted),
            "measured MiB": mib(measured["peak"]),
            "error %": round(100 * error, 2),
        }
        if "persistent" in measured:
            row["outside tensors MiB"] = mib(measured["persistent"])  # cuBLAS workspaces and the like, after the step
        rows.append(row)
    return rows, errors


def _moonshot(device: str) -> dict[str, Any]:
    """Estimate a >= 1B-parameter decoder step (fake tensors, no allocation), then run it for real on CUDA."""
    shape = SMOKE_MOONSHOT if smoke() else MOONSHOT
    batch_size = 2 if smoke() else MOONSHOT_BATCH
    config = TrainingConfig(precision="bf16-mixed")
    with torch.device("meta"):
        meta_model = CharLM(**shape)
    params = sum(p.numel() for p in meta_model.parameters())
    meta_x = torch.empty(batch_size, shape["block_size"], dtype=torch.long, device="meta")
    estimate = estimate_memory(meta_model, (meta_x, meta_x), device=device, config=config)
    predicted = estimate.peak_bytes + estimate.overheads.get("cublas_workspace", 0)
    result: dict[str, Any] = {
        "params": params,
        "predicted": predicted,
        "config": config.describe(),
        "shape": shape,
        "batch": batch_size,
    }
    if device != "cuda":
        return result  # nothing to compare with on CPU: the prediction alone (the dry run checks it runs)
    _cuda_release()
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised on the GPU: seconds instead of a minute of CPU init
        model = CharLM(**shape)
    x = torch.randint(0, 256, (batch_size, shape["block_size"]), device="cuda")
    optimizer = build_optimizer(config.optimizer.name, model.parameters())
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)  # as Lightning's MixedPrecision
    with autocast:
        _train_step(model, (x, x.roll(-1, 1)), default_loss, optimizer, config, None, loop=LOOP)
    with CudaPeak() as peak, autocast:
        _train_step(model, (x, x.roll(-1, 1)), default_loss, optimizer, config, None, loop=LOOP)
    result["measured"] = peak.peak
    del model, optimizer
    _cuda_release()
    return result


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    rows, errors = _compare(device, quick)
    moonshot = _moonshot(device)
    shape = SMOKE_SCALE_SHAPE if smoke() else SCALE_SHAPE
    scale = _scale(shape)
    plan = _plan_7b() if not quick else None
    # the planner's wall-time study is a CPU figure: a CUDA run (and the smoke run, which checks the CUDA run's path) skips it
    timing_rows, timings = run_timings(device) if device == "cpu" and not smoke() else ([], None)
    rows += timing_rows
    limit = 0.05 if device == "cpu" else 0.10
    cpu_target = "estimate within 5% of the measured peak on every configuration"
    targets = [
        {
            "target": f"estimate within {limit:.0%} of the measured peak on every configuration",
            "measured": f"max abs error {100 * max(errors):.2f}% over {len(errors)} configurations",
            "met": max(errors) <= limit,
            "twin": cpu_target,
        },
        {
            "target": "estimating a ~1B-parameter transformer step: < 60 s and < 2 GiB RSS",
            "measured": f"{scale['params'] / 1e9:.2f}B params: {scale['seconds']:.1f} s, max RSS "
            f"{scale['max_rss'] / 2**30:.2f} GiB (predicted CUDA peak {scale['peak'] / 2**30:.1f} GiB, bf16-mixed, batch 4x1024)",
            "met": scale["seconds"] < 60 and scale["max_rss"] < 2 * 2**30,
        },
    ]
    notes = (
        "Measured = the memory core's tracker on CPU, torch.cuda.max_memory_allocated on CUDA (estimate + "
        "cuBLAS workspace compared). Each row runs the same step function for real and on fake tensors."
    )
    if "measured" in moonshot:
        error = moonshot["predicted"] / moonshot["measured"] - 1
        rows.append(
            {
                "workload": f"moonshot: CharGPT {moonshot['shape']['n_layer']}x{moonshot['shape']['n_embd']} "
                f"({moonshot['params'] / 1e9:.2f}B params)",
                "batch": f"{moonshot['batch']}x{moonshot['shape']['block_size']}",
                "config": moonshot["config"],
                "estimated MiB": mib(moonshot["predicted"]),
                "measured MiB": mib(moonshot["measured"]),
                "error %": round(100 * error, 2),
            }
        )
        targets.append(
            {
                "target": "moonshot: a >= 1B-parameter decoder step, estimated before it runs, within 10% of the measured peak",
                "measured": f"{moonshot['params'] / 1e9:.2f}B params, {moonshot['config']}: estimated "
                f"{moonshot['predicted'] / 2**30:.2f} GiB, measured {moonshot['measured'] / 2**30:.2f} GiB "
                f"({100 * error:+.2f}%)",
                "met": moonshot["params"] >= 1e9 and abs(error) <= 0.10,
            }
        )
        notes += (
            f" Moonshot: CharGPT {moonshot['shape']}, batch {moonshot['batch']}, estimated on meta / fake tensors "
            "first (no allocation), then built on the GPU and stepped twice; the second step is measured."
        )
    if device == "cuda":
        notes += (
            " CUDA rows: each configuration starts from an empty device (earlier tensors freed, cuBLAS workspaces "
            "released), its second step measured; 'outside tensors MiB' = bytes still allocated after the step "
            "beyond the model, its optimizer state and the batch (cuBLAS workspaces of the forward and autograd threads)."
        )
    if plan:
        targets.append(
            {
                "target": "`lowmem estimate` finds a plan fitting 24 GiB for fine-tuning a 7B-shaped decoder",
                "measured": f"chosen [{plan['chosen']['label']}] predicted {plan['chosen']['predicted_peak_bytes'] / 2**30:.2f} GiB; "
                f"full fine-tune [{plan['baseline']['label']}] predicted {plan['baseline']['predicted_peak_bytes'] / 2**30:.2f} GiB",
                "met": bool(plan["chosen"]["fits"]),
            }
        )
    if timings is not None:
        targets += timing_targets(timings, plan)
        notes += (
            " plan_memory rows: wall time of the search on this machine (2 shared cores; the load average is in "
            "the targets), the chosen plan's full estimate ('estimated MiB') and its per-axis prediction."
        )
    return {"title": f"estimate_memory vs measured peak ({device})", "rows": rows, "targets": targets, "notes": notes}
