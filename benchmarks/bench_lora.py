"""LoRA / QLoRA vs full fine-tuning: charlm pretrained on one part of the stdlib, fine-tuned on another.

1. Pretrain a charlm (4 x 128) on stdlib files outside ``asyncio/`` and save its weights.
2. From those weights, fine-tune on ``asyncio/*`` for the same number of steps: full fine-tuning, LoRA
   (``LowRankAdapters``), QLoRA (int8 base; int8 / NF4 with ``quantize_frozen``). Report validation loss on
   ``asyncio``, the training step's peak memory and model state (memory core, one real step each), and step time.
3. Issue #33's Hugging Face Llama case (:mod:`benchmarks.qlora_llama`): bf16 LoRA vs int8 / NF4 QLoRA, the peak of
   a real fit and its estimate.
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import StepTimer, mib, quiet_trainer, set_seed, smoke
from lightning_lowmem.callbacks.low_rank_adapters import LowRankAdapters
from lightning_lowmem.demo import CharLM, CharLMDataModule
from lightning_lowmem.functional.lora.adapters import apply_lora_
from lightning_lowmem.memory import measure_memory, state_bytes

warnings.filterwarnings("ignore", ".*Enum subclass.*")
MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=64)
SMOKE_MODEL = dict(n_layer=1, n_head=2, n_embd=32, block_size=16)  # the dry run: code paths only
PRETRAIN_DATA = dict(exclude=["asyncio/*"], max_chars=600_000)
FINETUNE_DATA = dict(include=["asyncio/*"], max_chars=400_000)
QLORA_FROZEN = "QLoRA r=8, int8 base + int8 lm_head / embeddings"
# method -> (learning rate, LowRankAdapters kwargs or None); LoRA takes a larger step, as is usual
METHODS: dict[str, tuple[float, dict[str, Any] | None]] = {
    "full fine-tuning": (1e-3, None),
    "LoRA r=8": (6e-3, dict(r=8, alpha=16)),
    "QLoRA r=8, int8 base": (6e-3, dict(r=8, alpha=16, quantize_base="int8")),
    QLORA_FROZEN: (6e-3, dict(r=8, alpha=16, quantize_base="int8", quantize_frozen=True)),
    "QLoRA r=8, NF4 base + NF4 lm_head / 4-bit embeddings": (
        6e-3,
        dict(r=8, alpha=16, quantize_base="nf4", quantize_frozen=True),
    ),
}


def _model() -> dict[str, int]:
    """The charlm's shape: MODEL, or SMOKE_MODEL in a smoke run."""
    return SMOKE_MODEL if smoke() else MODEL


def _pretrain(steps: int, device: str, path: Path) -> None:
    set_seed(0)
    model = CharLM(**_model(), lr=3e-3)
    trainer = quiet_trainer(max_steps=steps, accelerator=device, limit_val_batches=0)
    trainer.fit(model, CharLMDataModule(block_size=_model()["block_size"], batch_size=16, **PRETRAIN_DATA))
    torch.save(model.state_dict(), path)


def _step_memory(model: CharLM, lora: dict[str, Any] | None, device: str) -> dict[str, int]:
    """Peak and model state of one training step (the second: optimizer state exists), memory core."""
    model = copy.deepcopy(model).to(device)
    if lora is not None:
        apply_lora_(model, **lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randint(0, 256, (16, _model()["block_size"]), device=device)
    batch = (x, x.roll(-1, 1))

    def step() -> None:
        model._loss(batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    report = measure_memory(step, module=model, optimizer=optimizer)
    # The tracker sizes a quantized weight (a torchao tensor subclass) it sees at entry as if it were
    # fp32; state_bytes opens it into its int8 / scale storages. Parameters do not change during the
    # step, so swapping in state_bytes' figure corrects both the parameter bytes and the peak.
    params = state_bytes(model)["parameters"]
    breakdown = report.breakdown
    during_step = report.phases["optimizer"]["breakdown"]  # gradients and optimizer state both alive
    adapters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and lora is not None)
    return {
        "peak": report.peak_bytes - breakdown["parameters"] + params,
        "params": params,
        "state": params + during_step["gradients"] + during_step["optimizer_state"],
        "base": params - adapters,
        "activations": report.breakdown["activations"],
    }


def _finetune(base: Path, lr: float, lora: dict[str, Any] | None, steps: int, device: str) -> dict[str, Any]:
    set_seed(0)
    model = CharLM(**_model(), lr=lr)
    model.load_state_dict(torch.load(base, weights_only=True))
    data = CharLMDataModule(block_size=_model()["block_size"], batch_size=16, **FINETUNE_DATA)
    timer = StepTimer(skip_first=5)
    callbacks = [timer] + ([LowRankAdapters(**lora)] if lora is not None else [])
    trainer = quiet_trainer(
        max_steps=steps, accelerator=device, callbacks=callbacks, limit_val_batches=2 if smoke() else 20
    )
    model.to(device)  # LowRankAdapters quantizes a QLoRA base in setup(), before Lightning moves the model
    trainer.fit(model, data)
    val_loss = float(trainer.validate(model, data, verbose=False)[0]["val_loss"])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"val_loss": val_loss, "step_s": timer.median_s, "trainable": trainable}


def _qlora_base_ratio_4x256() -> float:
    """Frozen int8 base bytes / fp32 parameter bytes for a charlm 4 x 256 (state_bytes; nothing trained)."""
    set_seed(0)
    model = CharLM(n_layer=4, n_head=4, n_embd=256, block_size=64)
    full = state_bytes(model)["parameters"]
    apply_lora_(model, r=8, alpha=16, quantize_base="int8")
    adapters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return (state_bytes(model)["parameters"] - adapters) / full


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    pretrain_steps, finetune_steps = (2, 2) if smoke() else (30, 15) if quick else (150, 60)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "pretrained.pt"
        _pretrain(pretrain_steps, device, base)
        pretrained = CharLM(**_model())
        pretrained.load_state_dict(torch.load(base, weights_only=True))
        data = CharLMDataModule(block_size=_model()["block_size"], batch_size=16, **FINETUNE_DATA)
        before = quiet_trainer(accelerator=device, limit_val_batches=2 if smoke() else 20).validate(
            pretrained, data, verbose=False
        )
        rows = [{"method": "pretrained, no fine-tuning", "asyncio val loss": round(before[0]["val_loss"], 4)}]
        results = {}
        for name, (lr, lora) in METHODS.items():
            results[name] = {
                **_finetune(base, lr, lora, finetune_steps, device),
                **_step_memory(pretrained, lora, device),
            }
    full = results["full fine-tuning"]
    for name, res in results.items():
        rows.append(
            {
                "method": name,
                "lr": METHODS[name][0],
                "asyncio val loss": round(res["val_loss"], 4),
                "trainable params": res["trainable"],
                "peak step memory (MiB)": mib(res["peak"]),
                "model state: params+grads+optim (MiB)": mib(res["state"]),
                "state vs full": round(res["state"] / full["state"], 3),
                "parameter bytes vs full": round(res["params"] / full["params"], 3),
                "frozen base bytes vs full params": round(res["base"] / full["params"], 3),
                "step time (ms)": round(1000 * res["step_s"], 1),
            }
        )
    lora, qlora, frozen = results["LoRA r=8"], results["QLoRA r=8, int8 base"], results[QLORA_FROZEN]
    base_4x256 = _qlora_base_ratio_4x256()
    loss_gap = lora["val_loss"] / full["val_loss"] - 1
    targets = [
        {
            "target": "LoRA val loss within 5% of full fine-tuning (same steps)",
            "measured": f"{lora['val_loss']:.4f} vs {full['val_loss']:.4f} ({100 * loss_gap:+.1f}%)",
            "met": loss_gap <= 0.05,
        },
        {
            "target": "LoRA model state (params + grads + optimizer) <= 0.4x full",
            "measured": f"{lora['state'] / full['state']:.3f}x",
            "met": lora["state"] <= 0.4 * full["state"],
        },
        {
            "target": "QLoRA int8 base <= 0.3x full parameter bytes (charlm 4x128, benchmarked model)",
            "measured": f"{qlora['base'] / full['params']:.3f}x ({qlora['params'] / full['params']:.3f}x with fp32 adapters)",
            "met": qlora["base"] <= 0.3 * full["params"],
        },
        {
            "target": "QLoRA int8 base <= 0.3x full parameter bytes (charlm 4x256)",
            "measured": f"{base_4x256:.3f}x",
            "met": base_4x256 <= 0.3,
        },
        {
            "target": "QLoRA int8 base <= 0.3x full parameter bytes (charlm 4x128, quantize_frozen=True)",
            "measured": f"{frozen['base'] / full['params']:.3f}x ({frozen['params'] / full['params']:.3f}x with fp32 adapters); "
            f"val loss {frozen['val_loss']:.4f}",
            "met": frozen["base"] <= 0.3 * full["params"],
        },
    ]
    notes = (
        f"charlm {_model()['n_layer']}x{_model()['n_embd']} pretrained {pretrain_steps} steps on stdlib files outside "
        f"asyncio/ ({PRETRAIN_DATA['max_chars']:,} bytes), then fine-tuned {finetune_steps} steps (batch 16x64) on "
        f"asyncio/* ({FINETUNE_DATA['max_chars']:,} bytes); val loss on asyncio's held-out 10% (20 batches). "
        "Memory: the second real training step measured by the memory core (peak; model state = parameters + "
        "gradients + optimizer state during optimizer.step, when all three are alive), parameter bytes from state_bytes (see _step_memory). "
        "LoRA wraps every linear layer but lm_head; embeddings and lm_head stay fp32 and, at n_embd=128, "
        "are ~16% of the parameters, which bounds QLoRA's parameter-byte ratio from below on this small model "
        "(the 4x256 row: embeddings are a smaller share); `quantize_frozen=True` stores them int8 too. Step times come from a 2-core machine shared "
        "with other jobs: compare them only within this table. Frozen quantized linears keep only the quantized "
        "weight for backward (int8 / NF4 dequantized a slab at a time)."
    )
    from benchmarks.qlora_llama import qlora_llama

    llama_rows, llama_targets, llama_notes = qlora_llama()
    rows, targets, notes = rows + llama_rows, targets + llama_targets, notes + llama_notes
    if device == "cuda" or smoke():  # QLoRA int4 (tinygemm, CUDA): benchmarks/int4_cuda.py; smoke runs it on CPU
        from benchmarks.int4_cuda import qlora_int4

        int4_rows, int4_targets, int4_notes = qlora_int4(device, quick)
        rows, targets, notes = rows + int4_rows, targets + int4_targets, notes + int4_notes
    return {
        "title": "LoRA / QLoRA vs full fine-tuning (charlm, stdlib -> asyncio)",
        "rows": rows,
        "targets": targets,
        "notes": notes,
    }
