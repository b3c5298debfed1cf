"""int4 on CUDA: weight-only PTQ (``bench_quantization --device cuda``) and QLoRA int4 (``bench_lora --device cuda``).

torchao's int4 weight-only format packs weights for the tinygemm kernel (CUDA, bf16). That kernel pads
``in_features`` to a multiple of 1024, so int4 only pays at widths of 1024 and more: both studies use a
charlm 2 x 1024 (the CPU twins' charlm 2 x 128 / 4 x 128 would store *more* bytes in int4 than in fp32).
Each row's CPU twin, where there is one, is read from ``benchmarks/results/<name>.json``.

In a smoke run on CPU (``gpu_check.py --dry-run``) the same code runs at a tiny size, with int4 replaced
by what runs on CPU (``intx4_weight_only``; QLoRA with an int8 base), labelled as such.
"""

from __future__ import annotations

import copy
import itertools
import json
import statistics
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import CudaPeak, mib, smoke, timed
from lightning_lowmem.demo.charlm import CharGPT, CharLMDataModule, GPTConfig
from lightning_lowmem.memory import state_bytes

RESULTS = Path(__file__).resolve().parent / "results"
WIDE = dict(n_layer=2, n_head=8, n_embd=1024, block_size=128)  # in_features 1024 / 4096: no tinygemm padding
SMOKE = dict(n_layer=1, n_head=2, n_embd=64, block_size=16)


def cpu_rows(name: str) -> list[dict[str, Any]]:
    """Rows of the CPU results of benchmark ``name`` (empty when there are none)."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()).get("rows", []) if path.exists() else []


def _train(device: str, steps: int, batch_size: int = 32) -> tuple[CharGPT, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A charlm trained ``steps`` AdamW steps on the stdlib corpus; returns it (fp32, eval) and 4 val batches."""
    shape = SMOKE if smoke() else WIDE
    data = CharLMDataModule(block_size=shape["block_size"], batch_size=batch_size, max_chars=400_000)
    data.setup("fit")
    torch.manual_seed(0)
    model = CharGPT(GPTConfig(**shape)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = itertools.chain.from_iterable(data.train_dataloader() for _ in itertools.count())  # epochs on end
    for _ in range(steps):
        x, y = (t.to(device) for t in next(batches))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    val = [(x.to(device), y.to(device)) for x, y in data.val_dataloader() if len(x) == batch_size][
        : 2 if smoke() else 4
    ]
    return model.eval(), val


@torch.inference_mode()
def _evaluate(model: nn.Module, val: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, torch.Tensor]:
    """Mean val loss and the logits of the first batch (float32)."""
    losses, first = [], None
    for x, y in val:
        logits = model(x).float()
        first = logits if first is None else first
        losses.append(float(F.cross_entropy(logits.flatten(0, 1), y.flatten())))
    assert first is not None
    return sum(losses) / len(losses), first


def _latency_ms(model: nn.Module, x: torch.Tensor, device: str) -> float:
    with torch.inference_mode():
        for _ in range(3):
            model(x)
        return 1000 * statistics.median(timed(lambda: model(x), device) for _ in range(2 if smoke() else 20))


def quantization_cuda(device: str, quick: bool) -> dict[str, Any]:
    """charlm 2 x 1024 trained on the GPU, then quantized per mode: size, val loss, output change, latency."""
    from lightning_lowmem.functional.quantization.ptq import quantize_

    warnings.filterwarnings("ignore")
    int4 = "int4_weight_only" if device == "cuda" else "intx4_weight_only"  # tinygemm int4 needs CUDA
    base, val = _train(device, 3 if smoke() else 150 if quick else 400)
    float_bytes = state_bytes(base)["parameters"]
    loss_fp32, logits_fp32 = _evaluate(base, val)
    bf16 = copy.deepcopy(base).to(torch.bfloat16)
    variants: dict[str, tuple[nn.Module, int]] = {
        "float32": (base, float_bytes),
        "bfloat16": (bf16, state_bytes(bf16)["parameters"]),
    }
    for mode in ("int8_weight_only", "int8_dynamic"):
        report = quantize_(copy.deepcopy(base), mode)
        variants[mode] = (report.module, report.bytes_after)
    for group in (32, 128):  # int4 quantizes the bf16 weights (the tinygemm kernel runs bf16)
        report = quantize_(copy.deepcopy(bf16), int4, group_size=group)
        variants[f"{int4} g{group}"] = (report.module, report.bytes_after)
    x = val[0][0]
    rows = []
    for name, (module, size) in variants.items():
        loss, logits = _evaluate(module, val)
        rows.append(
            {
                "workload": f"charlm {base.config.n_layer}x{base.config.n_embd} ({device})",
                "mode": name,
                "size_ratio": round(float_bytes / size, 3),
                "val_loss": round(loss, 4),
                "delta_%": round(100 * (loss / loss_fp32 - 1), 3),
                "logits_rel_change": float(f"{((logits - logits_fp32).norm() / logits_fp32.norm()).item():.3g}"),
                "latency_ms": round(_latency_ms(module, x, device), 3),
            }
        )
    for row in cpu_rows("quantization"):  # the CPU twin: charlm rows of the CPU study
        if str(row.get("workload", "")).startswith("charlm GPT") and row.get("mode") in (
            "float32",
            "int8_weight_only",
            "int8_dynamic",
            "intx4_weight_only",
        ):
            rows.append(
                {
                    "workload": f"CPU twin: {row['workload']}",
                    "mode": row["mode"],
                    "size_ratio": round(row["size_ratio"], 3),
                    "val_loss": round(row["metric"], 4),
                    "delta_%": round(row["delta"], 3),
                }
            )
    by_mode = {row["mode"]: row for row in rows if not row["workload"].startswith("CPU twin")}
    g32, g128 = by_mode[f"{int4} g32"], by_mode[f"{int4} g128"]
    targets = [
        {
            "target": f"charlm: int4 weight-only >= 5x smaller than float32 ({int4}, group 128, whole model)",
            "measured": f"{g128['size_ratio']:.2f}x (group 32: {g32['size_ratio']:.2f}x; int8_weight_only {by_mode['int8_weight_only']['size_ratio']:.2f}x)",
            "met": g128["size_ratio"] >= 5,
        },
        {
            "target": "charlm: int4 weight-only val loss within 2% of float32 (group 32)",
            "measured": f"{g32['delta_%']:+.2f}% (group 128 {g128['delta_%']:+.2f}%; logits change {g32['logits_rel_change']:.3g})",
            "met": g32["delta_%"] <= 2.0,
        },
        {
            "target": "charlm: int8 metric drop <= 1% relative val loss",
            "met": max(by_mode[m]["delta_%"] for m in ("int8_weight_only", "int8_dynamic")) <= 1.0,
            "measured": ", ".join(
                f"{m} {by_mode[m]['delta_%']:+.2f} % loss" for m in ("int8_weight_only", "int8_dynamic")
            ),
        },
    ]
    notes = (
        f"charlm GPT {base.config.n_layer}x{base.config.n_embd} (block {base.config.block_size}), trained on the "
        f"{device} with AdamW, then each mode applied to a copy with lightning_lowmem.functional.quantization.quantize_ "
        "(nn.Linear and nn.Embedding). int4 modes quantize the bfloat16 model (tinygemm runs bf16; its rows compare with "
        "float32 like the rest). size_ratio = float32 parameter bytes / the mode's (state_bytes: packed data, scales, "
        "zero points); delta_% = val-loss change vs float32 over 4 batches of 32x128; logits_rel_change = "
        "||logits - float32 logits|| / ||float32 logits|| on the first batch; latency_ms = median forward time, batch "
        "32x128, after synchronize. tinygemm pads in_features to a multiple of 1024, hence the width (at 128, int4 "
        "would store more bytes than fp32). CPU twin rows: charlm 2x128 from benchmarks/results/quantization.json "
        "(intx4 = int4 values in int8 bytes, CPU)."
        + ("" if device == "cuda" else " Smoke run on CPU: int4_weight_only replaced by intx4_weight_only.")
    )
    return {
        "title": f"Quantization on {device.upper()}: int8 and int4 weight-only (charlm)",
        "rows": rows,
        "targets": targets,
        "notes": notes,
    }


def qlora_int4(device: str, quick: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """QLoRA with an int4 (tinygemm) base against LoRA and QLoRA int8 on a charlm 2 x 1024: frozen base
    bytes, output change before training (adapters start at zero), training-step peak, val loss after
    fine-tuning. Returns ``(rows, targets, notes)`` for the LoRA table."""
    from lightning_lowmem.functional.lora.adapters import apply_lora_

    warnings.filterwarnings("ignore")
    int4 = "int4" if device == "cuda" else "int8"  # int4 needs CUDA: the smoke run checks the code path with int8
    name = int4 if device == "cuda" else "int8 [standing in for int4]"
    base, val = _train(device, 3 if smoke() else 100 if quick else 300)
    full_bytes = state_bytes(base)["parameters"]
    loss_fp32, logits_fp32 = _evaluate(base, val)
    data = CharLMDataModule(block_size=base.config.block_size, batch_size=16, max_chars=400_000, include=["asyncio/*"])
    data.setup("fit")
    # the first batches of one shuffled epoch (islice: the loader's other ~25,000 windows are never read)
    train = [
        (x.to(device), y.to(device))
        for x, y in itertools.islice(data.train_dataloader(), 2 if smoke() else 30 if quick else 100)
    ]
    rows, results = [], {}
    for label, lora in (
        ("LoRA r=8", {}),
        ("QLoRA r=8, int8 base", {"quantize_base": "int8"}),
        (f"QLoRA r=8, {name} base", {"quantize_base": int4}),
        (f"QLoRA r=8, {name} base + frozen rest", {"quantize_base": int4, "quantize_frozen": True}),
    ):
        model = copy.deepcopy(base).train()
        try:
            apply_lora_(model, r=8, alpha=16, **lora)
        except Exception as error:  # noqa: BLE001 - a backend that cannot run it is a result, not a crash
            rows.append({"method": label, "error": f"{type(error).__name__}: {str(error)[:300]}"})
            continue
        adapters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        base_bytes = state_bytes(model)["parameters"] - adapters
        loss_init, logits_init = _evaluate(model, val)  # B = 0: the output of the (quantized) base alone
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)

        def step(x: torch.Tensor, y: torch.Tensor, model: nn.Module = model, optimizer: Any = optimizer) -> None:
            F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        try:
            step(*train[0])
            if device == "cuda":
                with CudaPeak() as peak:
                    step(*train[1])
                step_peak = peak.peak
            else:
                step(*train[1])
                step_peak = 0
            for x, y in train[2:]:
                step(x, y)
            loss_after, _ = _evaluate(model, val)
        except Exception as error:  # noqa: BLE001
            rows.append(
                {
                    "method": label,
                    "base_vs_full": round(base_bytes / full_bytes, 3),
                    "error": f"training step failed: {type(error).__name__}: {str(error)[:300]}",
                }
            )
            continue
        results[label] = {
            "base": base_bytes / full_bytes,
            "init": loss_init,
            "change": (logits_init - logits_fp32).norm() / logits_fp32.norm(),
        }
        rows.append(
            {
                "method": label,
                "base_vs_full": round(base_bytes / full_bytes, 3),
                "init_delta_%": round(100 * (loss_init / loss_fp32 - 1), 3),
                "init_logits_rel_change": float(f"{results[label]['change'].item():.3g}"),
                "step_peak_MiB": mib(step_peak),
                "val_loss_after": round(loss_after, 4),
            }
        )
    rows = [{"workload": f"charlm {base.config.n_layer}x{base.config.n_embd} ({device})", **row} for row in rows]
    key = f"QLoRA r=8, {name} base"
    got = results.get(key)
    targets = [
        {
            "target": f"QLoRA {int4} base ({device}): frozen base <= 0.3x full parameter bytes (charlm {base.config.n_layer}x{base.config.n_embd})",
            "measured": f"{got['base']:.3f}x" if got else "did not run (see the row's error)",
            "met": bool(got) and got["base"] <= 0.3,
            "twin": "QLoRA int8 base <= 0.3x full parameter bytes (charlm 4x128, benchmarked model)",
        },
        {
            "target": f"QLoRA {int4} base ({device}): output before training within 2% val loss of float32, and it trains",
            "measured": (
                f"{100 * (got['init'] / loss_fp32 - 1):+.2f}% val loss, logits change {got['change']:.3g}"
                if got
                else "did not run (see the row's error)"
            ),
            "met": bool(got) and got["init"] / loss_fp32 - 1 <= 0.02,
        },
    ]
    notes = (
        f" QLoRA {int4} rows: charlm {base.config.n_layer}x{base.config.n_embd} (block {base.config.block_size}) "
        f"trained on the {device}, adapters r=8 on every linear but lm_head, fine-tuned {len(train)} steps (batch 16) on "
        "asyncio/*; base_vs_full = frozen (quantized) base bytes / fp32 parameter bytes; init_* = output of the "
        "quantized base before training (adapters start at zero) against float32; step_peak_MiB = "
        "torch.cuda.max_memory_allocated of the second training step. tinygemm int4 pads in_features to 1024, "
        "hence the width."
        + ("" if device == "cuda" else " Smoke run on CPU: the int4 rows run with an int8 base (int4 needs CUDA).")
    )
    return rows, targets, notes
