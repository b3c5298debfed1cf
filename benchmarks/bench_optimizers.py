"""Optimizer memory on charlm: optimizer-state bytes per lean optimizer, gradient bytes with optimizer-in-backward.

Every optimizer trains the same CharGPT (6 blocks x 128) from the same weights on the same batches; after
warm-up steps (which create the state) one more full step (forward, backward, optimizer step) is measured
with the memory core (``measure_memory``). Optimizers come from ``build_optimizer`` by name.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import mib, smoke
from lightning_lowmem.demo.charlm import CharGPT, CharLMDataModule, GPTConfig
from lightning_lowmem.functional.optimizers.catalog import build_optimizer
from lightning_lowmem.memory import measure_memory, state_bytes

N_LAYER, N_EMBD, N_HEAD, BLOCK_SIZE, BATCH_SIZE, LR = 6, 128, 4, 64, 16, 3e-3

# (row label, build_optimizer name, parameter dtype): adamw_bf16_sr is meant for bf16 weights (bf16-true)
SETUPS = [
    ("AdamW fp32 (anchor)", "adamw", torch.float32),
    ("AdamW 8-bit (torchao)", "adamw8bit", torch.float32),
    ("AdamW 4-bit (torchao)", "adamw4bit", torch.float32),
    ("Adafactor", "adafactor", torch.float32),
    ("AdamW bf16 + stochastic rounding (bf16 weights)", "adamw_bf16_sr", torch.bfloat16),
    ("AdamW in backward", "adamw_in_backward", torch.float32),
]


def _config() -> GPTConfig:
    return GPTConfig(n_layer=1 if smoke() else N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, block_size=BLOCK_SIZE)


def _batches(count: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = CharLMDataModule(block_size=BLOCK_SIZE, batch_size=BATCH_SIZE, max_chars=200_000)
    data.setup("fit")
    torch.manual_seed(0)
    batches = []
    for x, y in data.train_dataloader():
        batches.append((x.to(device), y.to(device)))
        if len(batches) == count:
            return batches
    raise RuntimeError(f"corpus too small for {count} batches")


class _LiveGradients:
    """Tracks the largest total of ``.grad`` bytes alive at any moment: checked with the memory core's
    ``state_bytes`` each time a gradient is accumulated. Create it *before* the optimizer so its hooks run
    before an optimizer-in-backward hook steps and frees the gradient (hooks run in registration order)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.max_bytes = 0
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in model.parameters()]

    def _on_grad(self, param: torch.Tensor) -> None:
        self.max_bytes = max(self.max_bytes, state_bytes(self.model)["gradients"])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _run(label: str, name: str, dtype: torch.dtype, batches: list, device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = CharGPT(_config()).to(device, dtype)
    live = _LiveGradients(model)
    optimizer = build_optimizer(name, model.parameters(), lr=LR, weight_decay=0.01)
    # torchao's per-parameter step is torch.compile'd: minutes of C++ compilation on CPU, so run it eagerly
    # there (measure_memory runs compiled regions eagerly anyway)
    stance = torch.compiler.set_stance("force_eager") if device == "cpu" else contextlib.nullcontext()

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        x, y = batch
        logits = model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        loss.backward()  # optimizer-in-backward steps here
        with stance:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    times, losses = [], []
    for batch in batches[:-1]:
        start = time.perf_counter()
        losses.append(step(batch))
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    live.max_bytes = 0
    report = measure_memory(step, batches[-1], module=model, optimizer=optimizer, device=device)
    live.remove()
    if hasattr(optimizer, "remove_hooks"):
        optimizer.remove_hooks()
    # gradient bytes alive at the step's peak and at each phase's peak (the memory core's snapshots)
    snapshots = [report.breakdown] + [phase["breakdown"] for phase in report.phases.values()]
    gradient_bytes = max(snapshot["gradients"] for snapshot in snapshots)
    return {
        "optimizer": label,
        "name": name,
        "param_dtype": str(dtype).removeprefix("torch."),
        "parameters_MiB": mib(report.breakdown["parameters"]),
        "optimizer_state_MiB": mib(report.breakdown["optimizer_state"]),
        "gradients_at_peaks_MiB": mib(gradient_bytes),
        "gradients_max_live_MiB": mib(live.max_bytes),
        "peak_MiB": mib(report.peak_bytes),
        "step_ms": round(1000 * statistics.median(times[1:] or times), 1),
        "loss": round(losses[-1], 4),
        "_state_bytes": report.breakdown["optimizer_state"],
        "_gradient_bytes": live.max_bytes,
        "_largest_param_bytes": max(p.numel() * p.element_size() for p in model.parameters()),
    }


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    steps = 1 if smoke() else 3 if quick else 6
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # on a shared 2-core machine one thread gives steadier steps
    try:
        batches = _batches(steps + 1, device)
        rows = [_run(label, name, dtype, batches, device) for label, name, dtype in SETUPS]
    finally:
        torch.set_num_threads(threads)
    by_name = {row["name"]: row for row in rows}
    anchor = by_name["adamw"]
    for row in rows:
        row["state_vs_adamw"] = round(row["_state_bytes"] / anchor["_state_bytes"], 3)
    eight_bit = by_name["adamw8bit"]["state_vs_adamw"]
    in_backward = by_name["adamw_in_backward"]
    largest = in_backward["_largest_param_bytes"]
    targets = [
        {
            "target": "AdamW 8-bit optimizer state <= 0.3x fp32 AdamW state",
            "measured": f"{eight_bit:.3f}x",
            "met": eight_bit <= 0.3,
        },
        {
            "target": "AdamW in backward: gradient bytes <= the largest parameter's bytes",
            "measured": f"{in_backward['_gradient_bytes']:,} B max alive vs largest parameter {largest:,} B "
            f"(plain AdamW: {anchor['_gradient_bytes']:,} B)",
            "met": in_backward["_gradient_bytes"] <= largest,
        },
    ]
    for row in rows:
        for key in [k for k in row if k.startswith("_")]:
            del row[key]
    num_params = sum(p.numel() for p in CharGPT(_config()).parameters())
    notes = (
        f"CharGPT {N_LAYER}x{N_EMBD} (heads {N_HEAD}, {num_params:,} parameters), "
        f"batch {BATCH_SIZE}x{BLOCK_SIZE}, lr {LR}, weight decay 0.01, {steps} warm-up steps then one measured "
        "step (memory core, `measure_memory`). `optimizer_state_MiB` / `gradients_at_peaks_MiB` are the bytes of "
        "that category alive at the step's peak or at a phase's (forward / backward / optimizer) peak, whichever "
        "is larger; `gradients_max_live_MiB` is the most `.grad` bytes alive at any moment (`state_bytes` checked "
        "each time a gradient lands, before an in-backward step frees it): the figure the in-backward target "
        "uses; with optimizer-in-backward the memory core's own `gradients_at_peaks_MiB` must agree with it "
        "(one parameter's gradient at a time). "
        "torchao's 8-/4-bit AdamW quantize only tensors of >= 4096 elements (biases and LayerNorm "
        "weights keep fp32 state). adamw_bf16_sr runs on bf16 weights (its intended use, precision bf16-true), so "
        "its parameters are half the size too. torchao steps run eagerly on CPU (compiling takes minutes)"
        + (", so their step times are not representative." if device == "cpu" else ".")
        + " `loss` is the last warm-up step's training loss (a sanity check, not a comparison)."
    )
    return {
        "title": "Optimizer memory on charlm (state bytes, optimizer-in-backward gradients)",
        "rows": rows,
        "targets": targets,
        "notes": notes,
    }
