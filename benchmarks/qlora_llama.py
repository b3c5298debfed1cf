"""QLoRA vs LoRA on a Hugging Face Llama (``bench_lora``): issue #33's case, measured in a real fit and estimated.

Llama with hidden 1024, 4 layers, intermediate 4096, 16 heads, vocabulary 8000, ``precision="bf16-true"``, adapters
``r=8`` on ``q_proj`` / ``v_proj``, batch 2 x 256. Three ways: bf16 LoRA, QLoRA with an int8 base and QLoRA with an
NF4 base (both ``quantize_frozen=True``: the other linear layers and the embedding quantized too). Each row is the
peak of the second training step of a real ``Trainer.fit`` (``MemoryMonitor``'s deep step, the memory core) and
``estimate_memory`` of the same step on fake tensors (``device="cpu"``).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from benchmarks.common import mib, quiet_trainer, smoke
from lightning_lowmem import MemoryMonitor
from lightning_lowmem.callbacks.low_rank_adapters import LowRankAdapters
from lightning_lowmem.demo.hf import HFLanguageModel
from lightning_lowmem.planning.estimate import estimate_memory

LLAMA = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=8000,
)
SMOKE_LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2, vocab_size=512)
ADAPTERS = dict(r=8, target=["q_proj", "v_proj"])
METHODS = {
    "Llama LoRA r=8, bf16 base": {},
    "Llama QLoRA r=8, int8 base (quantize_frozen)": dict(quantize_base="int8", quantize_frozen=True),
    "Llama QLoRA r=8, NF4 base (quantize_frozen)": dict(quantize_base="nf4", quantize_frozen=True),
}


def _module() -> HFLanguageModel:
    torch.manual_seed(0)
    return HFLanguageModel("llama", config=SMOKE_LLAMA if smoke() else LLAMA)


def _batch() -> dict[str, torch.Tensor]:
    shape = (2, 16) if smoke() else (2, 256)
    ids = torch.randint(
        0, (SMOKE_LLAMA if smoke() else LLAMA)["vocab_size"], shape, generator=torch.Generator().manual_seed(1)
    )
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _measure(quantize: dict[str, Any]) -> tuple[int, int]:
    """(measured peak, estimated peak) in bytes."""
    batch, lora = _batch(), {**ADAPTERS, **quantize}
    monitor = MemoryMonitor(summary=False)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = quiet_trainer(
            precision="bf16-true", max_steps=2, callbacks=[LowRankAdapters(**lora), monitor], default_root_dir=tmp
        )
        trainer.fit(_module(), torch.utils.data.DataLoader([batch] * 2, batch_size=None))
    estimate = estimate_memory(_module(), batch, device="cpu", precision="bf16-true", lora=lora)
    return monitor.last_report.peak_bytes, estimate.peak_bytes


def qlora_llama() -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """Rows, targets and notes of the Llama study (see the module docstring)."""
    peaks = {name: _measure(quantize) for name, quantize in METHODS.items()}
    rows = [
        {"method": name, "peak step memory (MiB)": mib(measured), "estimated peak (MiB)": mib(estimated)}
        for name, (measured, estimated) in peaks.items()
    ]
    lora, int8, nf4 = (peaks[name][0] for name in METHODS)
    targets = [
        {
            "target": "Llama: QLoRA peak below LoRA's (int8 and NF4 base, real fit)",
            "measured": f"NF4 {mib(nf4)} / int8 {mib(int8)} / LoRA {mib(lora)} MiB",
            "met": nf4 < lora and int8 < lora,
        },
        {
            "target": "Llama: estimate equals the measured peak (CPU), every row",
            "measured": ", ".join(f"{mib(e - m):+.2f}" for m, e in peaks.values()) + " MiB",
            "met": all(m == e for m, e in peaks.values()),
        },
    ]
    shape = "a tiny Llama (smoke run)" if smoke() else "Llama 1024 x 4 layers (intermediate 4096, vocab 8000)"
    notes = (
        f" Llama rows: {shape}, bf16-true, adapters r=8 on q_proj / v_proj, batch 2 x 256; peak of the second step "
        "of a real fit (MemoryMonitor) and estimate_memory(device='cpu') of the same step."
    )
    return rows, targets, notes
