"""Hugging Face models side by side with what Hugging Face / PEFT do themselves (GPT-2 and Llama configs).

Randomly initialised ``transformers`` models built from configs (no download), trained the way users train
them (dict batches ``{"input_ids", "attention_mask", "labels"}``, ``model(**batch).loss``), one section each:

* **checkpointing**: lightning_lowmem's ``ActivationCheckpointing("auto")`` (its functional form
  ``checkpoint_``, which also switches ``use_cache`` off) vs ``model.gradient_checkpointing_enable()``.
* **LoRA**: ``LowRankAdapters(r=8)`` (``apply_lora_``, default targets) vs PEFT's ``LoraConfig(r=8,
  target_modules=<the same layers>)`` when ``peft`` is installed: trainable parameters, peak, step time.
* **full stack**: bf16 weights + checkpointing + int8 activations + Adafactor stepped in backward vs plain fp32
  AdamW (the charlm stack of ``benchmarks/results/training_memory.md``).

Setups of a section train in lockstep from the same weights on the same batches; the last step of each is
measured with the memory core (peak bytes); step time is the median thread CPU time of the steps after warm-up.
On CPUs without native bf16 the full stack's bf16 matmuls are emulated and slow: its step time is not a
claim there (the peak is).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from benchmarks.common import mib
from lightning_lowmem.models.hf import HFTextDataModule, build_hf_model
from lightning_lowmem.functional.checkpointing import checkpoint_
from lightning_lowmem.functional.compression import compress_activations
from lightning_lowmem.functional.lora.adapters import apply_lora_
from lightning_lowmem.functional.optimizers.catalog import build_optimizer
from lightning_lowmem.memory import measure_memory

CONFIGS = {  # the shapes: 4 layers of width 128, vocabulary 512
    "gpt2": dict(vocab_size=512, n_embd=128, n_layer=4, n_head=4),
    "llama": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
SEQ_LEN, BATCH_SIZE = 128, 8


@dataclass
class Setup:
    name: str
    prepare: Callable[[torch.nn.Module], Any]  # transforms the model in place, returns what it reports
    optimizer: str = "adamw"
    lr: float = 1e-3
    compression: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _batches(steps: int) -> list[dict[str, torch.Tensor]]:
    data = HFTextDataModule("causal", seq_len=SEQ_LEN, batch_size=BATCH_SIZE, max_chars=300_000)
    data.setup("fit")
    torch.manual_seed(0)
    batches = []
    for batch in data.train_dataloader():
        batches.append({key: value.clamp_max(511) if key != "labels" else value for key, value in batch.items()})
        if len(batches) == steps + 1:
            return batches
    raise RuntimeError(f"corpus too small for {steps + 1} batches")


class _Run:
    def __init__(self, setup: Setup, base: torch.nn.Module) -> None:
        self.setup = setup
        self.model = copy.deepcopy(base)
        self.model.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            setup.info.update(setup.prepare(self.model) or {})
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in params)
        self.optimizer = build_optimizer(setup.optimizer, params, lr=setup.lr)
        self.cpu_s: list[float] = []
        self.losses: list[float] = []

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        packing = compress_activations(self.setup.compression) if self.setup.compression else contextlib.nullcontext()
        with packing:
            loss = self.model(**batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(float(loss))

    def timed_step(self, batch: dict[str, torch.Tensor]) -> None:
        start = time.thread_time()
        self.step(batch)
        self.cpu_s.append(time.thread_time() - start)


def _run_section(base: torch.nn.Module, setups: list[Setup], batches: list[dict], warmup: int) -> list[_Run]:
    runs = [_Run(setup, base) for setup in setups]
    for index, batch in enumerate(batches[:-1]):
        for run in runs if index % 2 == 0 else reversed(runs):  # alternate: machine load falls on all alike
            (run.step if index < warmup else run.timed_step)(batch)
    for run in runs:
        run.peak = measure_memory(run.step, batches[-1], module=run.model, optimizer=run.optimizer, device="cpu")
    return runs


def _lora_targets(model: torch.nn.Module) -> list[str]:
    probe = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [name.rsplit(".", 1)[-1] for name in apply_lora_(probe, r=8).wrapped]


def _peft(targets: list[str]) -> Callable[[torch.nn.Module], Any] | None:
    try:
        import peft
    except ImportError:
        return None

    def prepare(model: torch.nn.Module) -> dict[str, Any]:
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=sorted(set(targets)), lora_dropout=0.0)
        wrapped = peft.get_peft_model(model, config)
        model.__dict__["_peft"] = wrapped  # keep the wrapper alive; the model itself carries its layers
        return {"version": peft.__version__}

    return prepare


def _median_ms(run: _Run) -> float:
    return statistics.median(run.cpu_s) * 1e3


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    if device != "cpu":
        raise ValueError("bench_hf measures on CPU (the memory core's exact counts); see bench_memory for CUDA")
    torch.set_num_threads(1)
    steps, warmup = (4, 1) if quick else (10, 2)
    batches = _batches(steps)
    rows: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    for family, overrides in CONFIGS.items():
        torch.manual_seed(0)
        base = build_hf_model(family, **overrides)
        label = f"{family} ({sum(p.numel() for p in base.parameters()) / 1e6:.2f} M params)"

        def hf_checkpointing(model: torch.nn.Module) -> None:
            model.gradient_checkpointing_enable()

        checkpointing = _run_section(
            base,
            [
                Setup("no checkpointing (use_cache on, as configured)", lambda m: None),
                Setup("HF gradient_checkpointing_enable()", hf_checkpointing),
                Setup(
                    "lowmem ActivationCheckpointing('auto')", lambda m: {"wrapped": len(checkpoint_(m, "auto").wrapped)}
                ),
            ],
            batches,
            warmup,
        )
        plain, theirs, ours = checkpointing
        for item in checkpointing:
            rows.append(
                {
                    "model": label,
                    "section": "checkpointing",
                    "setup": item.setup.name,
                    "peak_mib": mib(item.peak.peak_bytes),
                    "step_ms": round(_median_ms(item), 1),
                    "final_loss": round(item.losses[-1], 4),
                }
            )
        ratio = ours.peak.peak_bytes / theirs.peak.peak_bytes
        targets.append(
            {
                "target": f"{family}: ActivationCheckpointing peak <= 1.02x gradient_checkpointing_enable()",
                "measured": f"{ratio:.3f}x (step time {_median_ms(ours) / _median_ms(theirs):.2f}x)",
                "met": ratio <= 1.02,
            }
        )

        lora_targets = _lora_targets(base)
        lora_setups = [
            Setup("lowmem LowRankAdapters(r=8)", lambda m: {"layers": len(apply_lora_(m, r=8).wrapped)}, lr=5e-3)
        ]
        peft_prepare = _peft(lora_targets)
        if peft_prepare is not None:
            lora_setups.append(Setup("PEFT LoraConfig(r=8, same layers)", peft_prepare, lr=5e-3))
        lora = _run_section(base, lora_setups, batches, warmup)
        for item in lora:
            rows.append(
                {
                    "model": label,
                    "section": "LoRA",
                    "setup": item.setup.name,
                    "trainable": item.trainable,
                    "peak_mib": mib(item.peak.peak_bytes),
                    "step_ms": round(_median_ms(item), 1),
                    "final_loss": round(item.losses[-1], 4),
                }
            )
        if len(lora) == 2:
            ours_lora, peft_lora = lora
            met = ours_lora.trainable <= peft_lora.trainable and ours_lora.peak.peak_bytes <= peft_lora.peak.peak_bytes
            targets.append(
                {
                    "target": f"{family}: our LoRA vs PEFT: trainable parameters and peak equal or better",
                    "measured": f"trainable {ours_lora.trainable:,} vs {peft_lora.trainable:,}; peak "
                    f"{ours_lora.peak.peak_bytes / peft_lora.peak.peak_bytes:.3f}x; step time "
                    f"{_median_ms(ours_lora) / _median_ms(peft_lora):.2f}x",
                    "met": met,
                }
            )

        def full_stack(model: torch.nn.Module) -> None:
            model.to(torch.bfloat16)
            checkpoint_(model, "auto")

        stack = _run_section(
            base,
            [
                Setup("plain fp32 AdamW (anchor)", lambda m: None),
                Setup(
                    "full stack: bf16 + ckpt(auto) + int8 + Adafactor in backward",
                    full_stack,
                    optimizer="adafactor_in_backward",
                    lr=0.05,
                    compression="int8",
                ),
            ],
            batches[-3:] if quick else batches[-4:],
            1,
        )
        anchor, lean = stack
        for item in stack:
            rows.append(
                {
                    "model": label,
                    "section": "full stack",
                    "setup": item.setup.name,
                    "peak_mib": mib(item.peak.peak_bytes),
                    **{f"{k}_mib": mib(v) for k, v in item.peak.breakdown.items()},
                }
            )
        ratio = anchor.peak.peak_bytes / lean.peak.peak_bytes
        targets.append(
            {
                "target": f"{family}: full stack peak <= 1/8 of plain fp32 AdamW",
                "measured": f"1/{ratio:.2f}",
                "met": ratio >= 8,
            }
        )
    return {
        "title": "Hugging Face models: lowmem vs Hugging Face / PEFT (GPT-2, Llama configs, CPU)",
        "rows": rows,
        "targets": targets,
        "notes": (
            f"Batch {BATCH_SIZE} x {SEQ_LEN} tokens, ragged right padding (attention_mask, -100 labels). "
            "Peak = memory core on the last step (second or later step: optimizer state included). Step time = median "
            "thread CPU time per step (1 torch thread), setups in lockstep. The full stack's step time is not shown: "
            "on CPUs without native bf16 its matmuls are emulated."
        ),
    }
