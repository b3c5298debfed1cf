"""The stack at real widths, measured without a meter (issue #36).

Hugging Face Llama at Llama-3.2-1B dims (hidden 2048, tied 128,256 vocabulary, 16 heads / 8 kv heads,
intermediate 8192), 2 of its 16 layers, one sequence of 2048 tokens, random weights. Each setup runs in its own
process; its peak is the process's peak RSS during the **second** step above the RSS before the model was built
(``/proc/self/clear_refs`` resets the high-water mark), with no dispatch-mode meter running, and its step time
is that step's thread CPU time (one torch thread). Setups: plain fp32 AdamW; ``bf16-true`` AdamW; Hugging Face's
own recipe (``gradient_checkpointing_enable`` + bf16 + torchao 8-bit AdamW); the lowmem stack (checkpointing +
int8 activations + chunked loss + Adafactor in backward) in fp32 and bf16. The physical floor is bf16 weights +
the largest gradient (the tied embedding's) + each block's boundary activation. Estimates (fake tensors) give the
full 16-layer model and Llama-3.1-8B dims (32 layers, 4096 wide, 128,256 untied). The floor counts the boundaries in
bf16; the stack keeps them as int8, so at full depth its estimate can fall below that floor. Step times are one
step each (not interleaved; a shared machine's load moves them): a ratio, not a speed. bf16 speed depends on the
CPU's bf16 instructions (AVX512-BF16, AMX): the notes end with the flags of the machine that ran it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings
from typing import Any

import torch

from benchmarks.common import mib, smoke

LLAMA_1B = dict(
    vocab_size=128_256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
LLAMA_8B = dict(LLAMA_1B, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, tie_word_embeddings=False)
SEQ = 2048
SETUPS = (
    "plain fp32 AdamW",
    "bf16-true AdamW",
    "HF recipe: gradient_checkpointing_enable + bf16 + 8-bit AdamW",
    "lowmem stack fp32",
    "lowmem stack bf16",
)
_STACK = dict(activation_checkpointing="auto", activation_compression="int8", optimizer="adafactor_in_backward")


def _setup(name: str) -> Any:
    from benchmarks.bench_llm import Setup
    from lightning_lowmem.functional.config import TrainingConfig

    if name == "plain fp32 AdamW":
        return Setup(name)
    if name == "bf16-true AdamW":
        return Setup(name, dtype=torch.bfloat16)
    if name.startswith("HF recipe"):
        return Setup(
            name, prepare=lambda m: m.gradient_checkpointing_enable(), dtype=torch.bfloat16, optimizer="adamw8bit"
        )
    precision = "bf16-true" if name.endswith("bf16") else "32-true"
    config = TrainingConfig(precision=precision, cross_entropy="chunked", **_STACK)
    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
    return Setup(name, config, dtype=dtype, optimizer="adafactor_in_backward", lr=0.05)


def _cpu_flags() -> str:
    """The CPU's vector / bf16 instruction flags (``/proc/cpuinfo``), for the notes."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next(line.split(":", 1)[1].split() for line in info if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = [flag for flag in flags if flag.startswith(("avx512", "amx")) or flag in ("avx2", "fma")]
    return " ".join(wanted) + ("" if "amx_bf16" in flags else " (no AMX)")


def _rss(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field))


def measure_one(name: str, overrides: dict[str, Any], seq: int) -> dict[str, Any]:
    """In this process: build, step once, reset the RSS high-water mark, step again; peak above the start."""
    from benchmarks.bench_llm import _batches, _Run
    from lightning_lowmem.demo.hf import build_hf_model

    import transformers  # noqa: F401 - libraries loaded before the start: their code is not the step's memory

    with torch.device("meta"):
        build_hf_model("llama", **{**overrides, "num_hidden_layers": 1})
    with contextlib.suppress(ImportError):
        import torchao.optim  # noqa: F401
    torch.set_num_threads(1)
    start = _rss("VmRSS:")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = _Run(_setup(name), build_hf_model("llama", **overrides))
    first, second = _batches(overrides["vocab_size"], 1, seq, 2, padded=False)
    run.step(first)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    run.step(second)
    return {"peak_bytes": _rss("VmHWM:") - start, "step_cpu_s": run.cpu_s[-1], "loss": run.losses[-1]}


def _measure(name: str, overrides: dict[str, Any], seq: int) -> dict[str, Any]:
    code = (
        "import json, sys; from benchmarks.bench_llm_real import measure_one; "
        "print(json.dumps(measure_one(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-c", code, name, json.dumps(overrides), str(seq)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=root,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _floor(overrides: dict[str, Any], seq: int) -> int:
    """bf16 weights + the largest gradient (the tied embedding's, bf16) + each block's boundary activation."""
    from lightning_lowmem.demo.hf import build_hf_model

    with torch.device("meta"):
        model = build_hf_model("llama", **overrides)
    numels = [p.numel() for p in model.parameters()]
    boundaries = (overrides["num_hidden_layers"] + 1) * seq * overrides["hidden_size"]
    return 2 * (sum(numels) + max(numels) + boundaries)


def _estimate(name: str, overrides: dict[str, Any], seq: int) -> int:
    from benchmarks.bench_llm import _batches
    from lightning_lowmem.demo.hf import build_hf_model
    from lightning_lowmem.planning.estimate import estimate_memory

    setup = _setup(name)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_hf_model("llama", **overrides)
    batch = _batches(overrides["vocab_size"], 1, seq, 1, padded=False)[0]
    report = estimate_memory(
        model,
        batch,
        loss_fn=lambda m, b: m(**b).loss,
        config=setup.config,
        precision="bf16-true" if setup.dtype == torch.bfloat16 else "32-true",
        device="cpu",
    )
    return report.peak_bytes


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    if device != "cpu":
        raise ValueError("bench_llm_real measures peak RSS on CPU")
    overrides, seq = dict(LLAMA_1B), SEQ
    if smoke() or quick:
        (overrides.update(vocab_size=8192, hidden_size=256, intermediate_size=1024),)
        seq = 256
    rows: list[dict[str, Any]] = []
    by_name: dict[str, dict[str, Any]] = {}
    for name in SETUPS:
        measured = _measure(name, overrides, seq)
        row = {
            "model": f"Llama H={overrides['hidden_size']}, V={overrides['vocab_size']:,} (tied), 2 layers, 1x{seq}",
            "setup": name,
            "peak_rss_mib": mib(measured["peak_bytes"]),
            "step_cpu_s": round(measured["step_cpu_s"], 2),
            "loss": round(measured["loss"], 4),
        }
        if name.startswith("lowmem"):
            row["estimate_mib"] = mib(_estimate(name, overrides, seq))
        rows.append(row)
        by_name[name] = row
    floor = _floor(overrides, seq)
    rows.append(
        {
            "model": rows[0]["model"],
            "setup": "physical floor (bf16 weights + largest grad + boundaries)",
            "peak_rss_mib": mib(floor),
        }
    )
    for label, dims, layers in (
        ("Llama-3.2-1B dims, 16 layers", LLAMA_1B, 16),
        ("Llama-3.1-8B dims, 32 layers", LLAMA_8B, 32),
    ):
        if smoke() or quick:
            break
        full = {**dims, "num_hidden_layers": layers}
        rows.append(
            {
                "model": f"{label}, 1x{seq}",
                "setup": "lowmem stack bf16 (estimate)",
                "estimate_mib": mib(_estimate("lowmem stack bf16", full, seq)),
                "floor_mib": mib(_floor(full, seq)),
            }
        )
    plain, bf16 = by_name["plain fp32 AdamW"], by_name["bf16-true AdamW"]
    hf, stack = by_name[SETUPS[2]], by_name["lowmem stack bf16"]
    targets = [
        {
            "target": "1B dims: bf16 stack <= 1/6 of plain fp32 (peak RSS)",
            "measured": f"1/{plain['peak_rss_mib'] / stack['peak_rss_mib']:.2f}",
            "met": stack["peak_rss_mib"] * 6 <= plain["peak_rss_mib"],
        },
        {
            "target": "1B dims: bf16 stack <= 0.3x HF's recipe",
            "measured": f"{stack['peak_rss_mib'] / hf['peak_rss_mib']:.3f}x",
            "met": stack["peak_rss_mib"] <= 0.3 * hf["peak_rss_mib"],
        },
        {
            "target": "1B dims: bf16 stack within 1.3x of the physical floor",
            "measured": f"{stack['peak_rss_mib'] / mib(floor):.2f}x",
            "met": stack["peak_rss_mib"] <= 1.3 * mib(floor),
        },
        {
            "target": "1B dims: bf16 stack step time <= 1.35x bf16-true's",
            "measured": f"{stack['step_cpu_s'] / bf16['step_cpu_s']:.2f}x",
            "met": stack["step_cpu_s"] <= 1.35 * bf16["step_cpu_s"],
        },
    ]
    return {
        "title": "The stack at real widths: Llama-3.2-1B dims, peak RSS without a meter (CPU)",
        "rows": rows,
        "targets": targets,
        "notes": f"{__doc__}\nCPU flags: {_cpu_flags()}.",
    }
