"""The chunked loss beside the plain one and the fused CUDA kernels it dispatches to (#36): one forward + backward
of the output head's loss, its time and its peak memory.

Rows, each ``loss(hidden, weight, targets).backward()`` with ``hidden`` ``(N, H)`` and ``weight`` ``(V, H)``
requiring gradients, at Llama-3's vocabulary (V = 128,256), N = 4096 tokens, H = 2048 (Llama-3.2-1B) and
4096 (Llama-3.1-8B), bf16 on CUDA:

* ``plain``: ``F.cross_entropy((hidden @ weight.T).float(), targets)`` (the logits, their fp32 upcast and the
  log-softmax saved for backward: Hugging Face's loss);
* ``lowmem``: ``linear_cross_entropy(..., kernel="lowmem")``, ours (plain torch ops, two passes in bf16);
* ``liger``: Liger-Kernel's fused linear cross-entropy (``kernel="liger"``; ``pip install
  'lightning-lowmem[liger]'``), ``cce``: Apple's Cut Cross-Entropy (``kernel="cce"``): each skipped, with the
  reason, when the library is not installed (or not on CUDA);
* ``auto``: the default, ``kernel="auto"``, with the kernel it picks.

``ms``: the fastest of 5 timed runs after 2 warm-ups (the first pays Triton's compilation and autotuning);
``peak MiB``: the allocator's peak above the inputs during one run (``torch.cuda.max_memory_allocated``),
``working MiB``: that less the gradients of ``hidden`` and ``weight`` (which every method hands back). On
CPU (no fused kernel) the shapes are smaller (V = 32,000, N = 1024, H = 512, fp32) and the peak is the memory
core's tracker's; the targets are the CUDA ones.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

import torch
from torch.nn import functional as F

from benchmarks.common import CudaPeak, mib, smoke, synchronize
from lightning_lowmem.functional.cross_entropy import linear_cross_entropy
from lightning_lowmem.functional.cross_entropy.kernels import LIBRARIES, resolve_kernel
from lightning_lowmem.memory import measure_memory

VOCAB = 128_256
TOKENS = 4096
WIDTHS = (2048, 4096)
METHODS = ("plain", "lowmem", "liger", "cce", "auto")
WARMUP, REPEATS = 2, 5


def _shapes(device: str) -> tuple[int, int, tuple[int, ...], torch.dtype]:
    """(V, N, widths, dtype) for this run."""
    if smoke():
        return 512, 64, (32,), torch.float32
    if device == "cpu":
        return 32_000, 1024, (512,), torch.float32
    return VOCAB, TOKENS, WIDTHS, torch.bfloat16


def _loss(method: str) -> Callable[..., torch.Tensor]:
    if method == "plain":
        return lambda hidden, weight, targets: F.cross_entropy((hidden @ weight.T).float(), targets)
    kernel = method
    return lambda hidden, weight, targets: linear_cross_entropy(hidden, weight, targets, kernel=kernel)


def _skip_reason(method: str, hidden: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why ``kernel=method`` cannot run here (library missing, not CUDA, ...), or ``None``."""
    if method in ("plain", "lowmem", "auto"):
        return None
    try:
        resolve_kernel(method, hidden, weight)
    except ImportError:
        return f"{LIBRARIES[method].package} not installed (pip install 'lightning-lowmem[{method}]')"
    except ValueError as error:  # e.g. not on CUDA
        return str(error).split("cannot compute this loss: ")[-1].split(". Use kernel=")[0]
    return None


def _measure(method: str, device: str, vocab: int, tokens: int, width: int, dtype: torch.dtype) -> dict[str, Any]:
    torch.manual_seed(0)
    hidden = (torch.randn(tokens, width, device=device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, width, device=device) / width**0.5).to(dtype).requires_grad_()
    targets = torch.randint(vocab, (tokens,), device=device)
    row: dict[str, Any] = {"method": method, "V": vocab, "N": tokens, "H": width, "dtype": str(dtype).split(".")[-1]}
    reason = _skip_reason(method, hidden, weight)
    if reason is not None:
        return {**row, "ms": "-", "peak MiB": "-", "working MiB": "-", "skipped": reason}
    loss_fn = _loss(method)

    def step() -> None:
        hidden.grad = weight.grad = None
        loss_fn(hidden, weight, targets).backward()

    if method == "auto":
        row["picks"] = resolve_kernel("auto", hidden, weight)
    times = []
    for index in range(WARMUP + REPEATS):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        if index >= WARMUP:
            times.append(time.perf_counter() - start)
    hidden.grad = weight.grad = None
    gc.collect()
    if device == "cuda":
        with CudaPeak() as peak:
            step()
        peak_bytes = peak.peak_above_baseline
    else:
        peak_bytes = measure_memory(step, device="cpu").peak_bytes
    gradients = (hidden.numel() + weight.numel()) * hidden.element_size()  # what every method hands back
    return {
        **row,
        "ms": round(min(times) * 1e3, 2),
        "peak MiB": mib(peak_bytes),
        "working MiB": mib(peak_bytes - gradients),
    }


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(row["method"], row["H"]): row for row in rows}
    widths = sorted({row["H"] for row in rows})
    speed, memory = [], []
    for width in widths:
        plain, auto = by[("plain", width)], by[("auto", width)]
        speed.append((width, auto["ms"] / plain["ms"], auto.get("picks", "?")))
        memory.append((width, auto["working MiB"] / plain["working MiB"]))
    return [
        {
            "target": "the chunked loss (kernel='auto') at least as fast as the plain loss (forward + backward)",
            "measured": ", ".join(f"H={w}: {ratio:.2f}x ({picks})" for w, ratio, picks in speed),
            "met": all(ratio <= 1.0 for _, ratio, _ in speed),
        },
        {
            "target": "its memory bound stays: working memory (peak less the gradients) at most 1/4 of the plain loss's",
            "measured": ", ".join(f"H={w}: {ratio:.3f}x" for w, ratio in memory),
            "met": all(ratio <= 0.25 for _, ratio in memory),
        },
    ]


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    vocab, tokens, widths, dtype = _shapes(device)
    rows = []
    for width in widths:
        for method in METHODS:
            try:
                rows.append(_measure(method, device, vocab, tokens, width, dtype))
            except Exception as error:  # noqa: BLE001 - one method's failure is a result, the others still run
                rows.append({"method": method, "H": width, "error": f"{type(error).__name__}: {error}"[:300]})
            if device == "cuda":
                torch.cuda.empty_cache()
    measured = [row for row in rows if "error" not in row]
    return {
        "title": f"The chunked loss vs the plain one and the fused kernels, forward + backward ({device})",
        "rows": rows,
        "targets": _targets(measured) if len(measured) == len(rows) else [],
        "notes": (
            "Written by benchmarks/bench_loss_kernels.py: the output head's loss alone, the fastest of 5 runs after "
            "2 warm-ups; peak above the inputs. liger / cce rows run only where the library is installed "
            "(pip install 'lightning-lowmem[liger]' / '[cce]') and on CUDA; 'auto' names the kernel it picked."
        ),
    }
