"""Training memory switches on charlm: peak (memory core), step time and loss per switch and stacked.

Every configuration trains the same CharGPT (6 blocks x 128, batch 32 x 64 bytes of stdlib source) from
the same initial weights on the same batches, then one more step is measured with the memory core.
Lightning's ``bf16-true`` is reproduced as ``model.to(torch.bfloat16)`` (what its precision plugin does).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import mib
from lightning_lowmem.demo.charlm import CharGPT, CharLMDataModule, GPTConfig
from lightning_lowmem.functional.checkpointing import checkpoint_
from lightning_lowmem.functional.compression import compress_activations
from lightning_lowmem.functional.optimizers import build_optimizer
from lightning_lowmem.memory import CATEGORIES, measure_memory

N_LAYER, N_EMBD, N_HEAD, BLOCK_SIZE, BATCH_SIZE, LR = 6, 128, 4, 64, 32, 3e-3
NESTED = [["Block"], ["*.attn", "*.mlp"]]  # blocks, then attn / mlp inside them: recompute one half-block at a time


@dataclass
class Setup:
    name: str
    dtype: torch.dtype = torch.float32
    checkpointing: list[Any] = field(default_factory=list)  # one checkpoint_ policy per call (nesting)
    compression: str | None = None
    optimizer: str = "adamw"


SETUPS = [
    Setup("plain fp32 AdamW (anchor)"),
    Setup("bf16-true AdamW", dtype=torch.bfloat16),
    Setup("fp32 + checkpointing(Block)", checkpointing=["Block"]),
    Setup("fp32 + compression bf16", compression="bf16"),
    Setup("fp32 + compression int8", compression="int8"),
    Setup("bf16-true + checkpointing(Block)", dtype=torch.bfloat16, checkpointing=["Block"]),
    Setup("full stack: bf16-true + ckpt(Block) + int8 + AdamW8bit", torch.bfloat16, ["Block"], "int8", "adamw8bit"),
    Setup("full stack, nested ckpt (Block, then attn/mlp)", torch.bfloat16, NESTED, "int8", "adamw8bit"),
]


def _optimizer(name: str, params: Any, device: str) -> tuple[torch.optim.Optimizer, str]:
    """``build_optimizer(name)``; for ``adamw8bit`` falls back to torchao's AdamW8bit when the name is not
    registered yet. Returns the optimizer and a note on what was used."""
    try:
        return build_optimizer(name, params, lr=LR, weight_decay=0.01), f"build_optimizer({name!r})"
    except ValueError:
        if name != "adamw8bit":
            raise
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=LR, weight_decay=0.01), "torchao.optim.AdamW8bit (build_optimizer lacks 'adamw8bit')"


def _batches(steps: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = CharLMDataModule(block_size=BLOCK_SIZE, batch_size=BATCH_SIZE, max_chars=400_000)
    data.setup("fit")
    torch.manual_seed(0)
    batches = []
    for x, y in data.train_dataloader():
        batches.append((x.to(device), y.to(device)))
        if len(batches) == steps + 1:
            return batches
    raise RuntimeError(f"corpus too small for {steps + 1} batches")


def _run_setup(setup: Setup, batches: list, device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = CharGPT(GPTConfig(n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, block_size=BLOCK_SIZE)).to(device, setup.dtype)
    for policy in setup.checkpointing:
        checkpoint_(model, policy)
    optimizer, optimizer_note = _optimizer(setup.optimizer, model.parameters(), device)
    # torchao's 8-bit step is torch.compile'd: minutes of C++ compilation on CPU, so run it eagerly there
    stance = torch.compiler.set_stance("force_eager") if device == "cpu" else contextlib.nullcontext()

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        x, y = batch
        with compress_activations(setup.compression) if setup.compression else contextlib.nullcontext():
            logits = model(x)  # (B, T, V)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        loss.backward()
        with stance:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    losses, times = [], []
    for batch in batches[:-1]:
        start = time.perf_counter()
        losses.append(step(batch))
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    report = measure_memory(step, batches[-1], module=model, optimizer=optimizer, device=device)
    row = {"setup": setup.name, "peak_MiB": mib(report.peak_bytes)}
    row.update({f"{c}_MiB": mib(report.breakdown[c]) for c in CATEGORIES})
    row["step_ms"] = round(1000 * statistics.median(times[2:] or times), 1)
    row["loss"] = round(sum(losses[-5:]) / len(losses[-5:]), 4)
    return {"row": row, "optimizer_note": optimizer_note}


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    steps = 5 if quick else 15
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # on a shared 2-core machine one thread gives steadier (and faster) steps
    try:
        batches = _batches(steps, device)
        results = [_run_setup(setup, batches, device) for setup in SETUPS]
    finally:
        torch.set_num_threads(threads)
    rows = [r["row"] for r in results]
    by_name = {row["setup"]: row for row in rows}
    fp32, bf16 = rows[0], rows[1]
    for row in rows:
        row["peak_vs_fp32"] = round(row["peak_MiB"] / fp32["peak_MiB"], 3)
        row["peak_vs_bf16"] = round(row["peak_MiB"] / bf16["peak_MiB"], 3)
        row["time_vs_bf16"] = round(row["step_ms"] / bf16["step_ms"], 2)
        row["loss_vs_fp32"] = round(row["loss"] / fp32["loss"] - 1, 4)

    def act_cut(name: str) -> float:
        return fp32["activations_MiB"] / max(by_name[name]["activations_MiB"], 1e-9)

    targets = [
        {"target": "checkpointing cuts activation bytes >= 3x", "measured": f"{act_cut(SETUPS[2].name):.1f}x",
         "met": act_cut(SETUPS[2].name) >= 3},
        {"target": "int8 compression cuts activation bytes >= 2.5x", "measured": f"{act_cut(SETUPS[4].name):.1f}x",
         "met": act_cut(SETUPS[4].name) >= 2.5},
    ]
    for row in rows[-2:]:
        label = "full stack" if row is rows[-2] else "full stack, nested ckpt"
        targets += [
            {"target": f"{label}: peak <= 1/8 of plain fp32", "measured": f"1/{1 / row['peak_vs_fp32']:.1f}",
             "met": row["peak_vs_fp32"] <= 1 / 8},
            {"target": f"{label}: peak <= 1/4 of bf16-true", "measured": f"1/{1 / row['peak_vs_bf16']:.1f}",
             "met": row["peak_vs_bf16"] <= 1 / 4},
            {"target": f"{label}: step time <= 1.35x bf16-true", "measured": f"{row['time_vs_bf16']:.2f}x",
             "met": row["time_vs_bf16"] <= 1.35},
            {"target": f"{label}: loss within 3% of plain fp32", "measured": f"{100 * row['loss_vs_fp32']:+.2f}%",
             "met": abs(row["loss_vs_fp32"]) <= 0.03},
        ]
    notes = (
        f"CharGPT {N_LAYER}x{N_EMBD} (heads {N_HEAD}), batch {BATCH_SIZE}x{BLOCK_SIZE}, AdamW lr {LR}, {steps} steps on "
        "the same batches from the same weights; loss = mean of the last 5 training losses; step time = median "
        "after 2 warm-up steps; peak = memory core (measure_memory) on one more full step (forward, backward, "
        f"optimizer step). 8-bit optimizer: {results[-1]['optimizer_note']}"
        + ("; run eagerly on CPU (torch.compiler.set_stance('force_eager')) because compiling its step takes minutes."
           if device == "cpu" else ".")
        + " CPU runs use 1 thread. On CPU bf16 matmuls are ~3x slower than fp32, so time ratios against "
        "bf16-true are CPU figures, not GPU ones; the memory ratios do not depend on the device."
    )
    return {"title": "Training memory switches on charlm (checkpointing, compression, full stack)", "rows": rows,
            "targets": targets, "notes": notes}
