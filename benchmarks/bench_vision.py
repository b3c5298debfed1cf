"""Models users bring beyond HF text: the planner's answer on a tiny Hugging Face ResNet at a budget only
``bf16-true`` fits (predicted vs measured peak), the same on a flat ``nn.Sequential`` CNN where checkpointing
``"auto"`` has no block to wrap (those candidates skipped and listed, not "nothing fits"), checkpointing
``"auto"``'s activation bytes on the ResNet and an ``nn.Transformer``, LoRA against full fine-tuning on both
(LoRA on the ResNet's convolutions, on the Transformer's ``nn.MultiheadAttention`` projections and linear layers):
trainable parameters, predicted and measured peaks (memory core, CPU); int8 conv nets trained on digits (size
ratio, accuracy change, inference peaks) and each lean optimizer's state and step peak per model family
(:mod:`benchmarks._vision_rows`); the libraries' own recipes beside ours -- Hugging Face's
``gradient_checkpointing_enable()`` beside checkpointing ``"auto"`` on HF ViT / ResNet / ConvNeXt, torchao's int8
configs beside ``int8_weight_only`` on the same trained CNNs (:mod:`benchmarks._vision_baselines`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from benchmarks._vision_baselines import checkpointing_rows, torchao_rows
from benchmarks._vision_rows import markdown, optimizer_rows, quantization_rows, trained_cnns
from benchmarks.common import mib, smoke
from lightning_lowmem.functional.checkpointing import checkpoint_, resolve_policy
from lightning_lowmem.functional.optimizers.catalog import build_optimizer
from lightning_lowmem.memory import measure_memory
from lightning_lowmem.planning.estimate import (
    TrainingConfig,
    _apply_model_techniques,
    _train_step,
    default_loss,
    estimate_memory,
)
from lightning_lowmem.planning.plan import plan_memory

LOOP = "torch"  # plain modules: torch's order (zero_grad before the forward), as estimate_memory picks for them


def _resnet(small: bool) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    sizes, depths = ([8, 16], [1, 1]) if small else ([16, 32], [2, 2])
    config = ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=sizes, depths=depths, layer_type="basic", num_labels=10
    )
    return ResNetForImageClassification(config)


def _flat_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def _batch(batch_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 3, size, size, generator=generator), torch.randint(
        0, 10, (batch_size,), generator=generator
    )


def _measured_peak(model: nn.Module, batch: Any, config: TrainingConfig) -> int:
    """The real step's peak (memory core, CPU), its second step (optimizer state alive)."""
    model = copy.deepcopy(model)
    if config.precision_preset == "bf16-true":
        model = model.to(torch.bfloat16)
        batch = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in batch)
    autocast_dtype = torch.bfloat16 if config.precision_preset == "bf16-mixed" else None
    _apply_model_techniques(model, config)
    optimizer = build_optimizer(config.optimizer.name, [p for p in model.parameters() if p.requires_grad])
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
        device="cpu",
    )
    return report.peak_bytes


def _plan_row(name: str, model: nn.Module, batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    def full(precision: str) -> int:
        config = TrainingConfig(precision=precision, optimizer="adamw")
        return estimate_memory(model, batch, device="cpu", config=config, loop=LOOP).peak_bytes

    bf16_true, bf16_mixed = full("bf16-true"), full("bf16-mixed")
    budget = int((bf16_true + bf16_mixed) / 2 / 0.9)  # usable (after the 10% margin) midway between the two
    plan = plan_memory(model, batch, budget, device="cpu", loop=LOOP)
    measured = _measured_peak(model, batch, plan.config)
    error = plan.predicted_peak_bytes / measured - 1
    skipped = sum(len(labels) for labels in plan.skipped.values())
    row = {
        "model": name,
        "budget MiB": mib(budget),
        "usable MiB": mib(plan.usable_bytes),
        "32-true MiB (est.)": mib(full("32-true")),
        "bf16-mixed MiB (est.)": mib(bf16_mixed),
        "chosen": plan.config.describe(),
        "predicted MiB": mib(plan.predicted_peak_bytes),
        "measured MiB": mib(measured),
        "error %": round(100 * error, 2),
        "skipped candidates": skipped,
        "plan s": round(plan.seconds, 2),
    }
    return row, {"error": error, "chosen": plan.config.precision_preset, "skipped": plan.skipped}


def _checkpointing_row(name: str, model: nn.Module, batch: Any) -> dict[str, Any]:
    inputs, labels = batch

    def activations(wrapped: bool) -> tuple[int, int]:
        copy_ = copy.deepcopy(model).train()
        if wrapped:
            checkpoint_(copy_, "auto")

        def step() -> None:
            out = copy_(inputs)
            nn.functional.cross_entropy(getattr(out, "logits", out), labels).backward()

        report = measure_memory(step, module=copy_)
        return report.breakdown["activations"], report.peak_bytes

    plain, wrapped = activations(False), activations(True)
    return {
        "model": name,
        "auto wraps": len(resolve_policy(model, "auto")),
        "activations MiB": mib(plain[0]),
        "with auto MiB": mib(wrapped[0]),
        "activations ratio": round(plain[0] / wrapped[0], 2),
        "peak MiB": mib(plain[1]),
        "peak with auto MiB": mib(wrapped[1]),
    }


def _lora_row(name: str, model: nn.Module, batch: Any, lora: dict[str, Any] | None) -> dict[str, Any]:
    """Full fine-tuning (``lora=None``) or LoRA, fp32 + AdamW: trainable parameters, predicted vs measured peak."""
    config = TrainingConfig(optimizer="adamw", lora=lora)
    estimate = estimate_memory(model, batch, device="cpu", config=config, loop=LOOP)
    measured = _measured_peak(model, batch, config)
    copy_ = copy.deepcopy(model)
    _apply_model_techniques(copy_, config)
    trainable = sum(p.numel() for p in copy_.parameters() if p.requires_grad)
    return {
        "model": name,
        "method": "full fine-tuning" if lora is None else f"LoRA r={lora['r']}, target={lora['target']}",
        "trainable params": trainable,
        "total params": sum(p.numel() for p in model.parameters()),
        "optimizer state MiB": mib(estimate.breakdown["optimizer_state"]),
        "predicted MiB": mib(estimate.peak_bytes),
        "measured MiB": mib(measured),
        "error %": round(100 * (estimate.peak_bytes / measured - 1), 2),
    }


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    # one intra-op thread (restored after): these tiny models gain nothing from two, and on a loaded 2-core machine
    # two threads wait on each other (training the digits CNNs took 83 s with two, 1.5 s with one); the memory
    # core's bytes do not depend on it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(small=quick or smoke())
    finally:
        torch.set_num_threads(threads)


def _run(small: bool) -> dict[str, Any]:
    batch = _batch(8 if small else 16, 32 if small else 64)
    resnet_row, resnet = _plan_row("HF ResNet (tiny)", _resnet(small), batch)
    cnn_row, cnn = _plan_row("flat nn.Sequential CNN", _flat_cnn(), batch)
    tokens = torch.randint(0, 50, (8, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 64)
            self.transformer = nn.Transformer(64, 4, 2, 2, dim_feedforward=128, dropout=0.0, batch_first=True)
            self.head = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            return self.head(self.transformer(h, h).mean(dim=1))

    checkpointing = [
        _checkpointing_row("HF ResNet (tiny)", _resnet(small), batch),
        _checkpointing_row("nn.Transformer 2+2 layers", Seq2Seq(), (tokens, torch.randint(0, 10, (8,)))),
    ]
    lora = []
    for label, build, data, target in (
        ("HF ResNet (tiny)", lambda: _resnet(small), batch, "all-conv"),
        ("nn.Transformer 2+2 layers", Seq2Seq, (tokens, torch.randint(0, 10, (8,))), "all-linear"),
    ):
        torch.manual_seed(0)
        model = build()
        lora += [_lora_row(label, model, data, None), _lora_row(label, model, data, {"r": 8, "target": target})]
    rows = [resnet_row, cnn_row]
    digits, cnns = trained_cnns(small)
    quantization, optimizers = quantization_rows(digits, cnns), optimizer_rows(small)
    checkpointing_baselines, torchao = checkpointing_rows(small), torchao_rows(digits, cnns)
    targets = [
        {
            "target": "HF ResNet at a budget only bf16-true fits: the plan is bf16-true, within 5% of the measured peak",
            "measured": f"chosen {resnet_row['chosen']}: predicted {resnet_row['predicted MiB']} MiB, measured "
            f"{resnet_row['measured MiB']} MiB ({resnet_row['error %']:+.2f}%)",
            "met": resnet["chosen"] == "bf16-true" and abs(resnet["error"]) <= 0.05,
        },
        {
            "target": "flat nn.Sequential CNN: candidates that cannot be built are skipped and listed, a plan is found",
            "measured": f"chosen {cnn_row['chosen']} ({cnn_row['error %']:+.2f}% vs measured); skipped "
            f"{cnn_row['skipped candidates']}: {'; '.join(cnn['skipped'])}",
            "met": cnn["chosen"] == "bf16-true" and cnn_row["skipped candidates"] > 0,
        },
        *(
            {
                "target": f"{full['model']}, {adapted['method']} vs full fine-tuning: the estimate equals the measured "
                "peak",
                "measured": f"{adapted['trainable params']:,} of {full['trainable params']:,} parameters trainable "
                f"({100 * adapted['trainable params'] / full['trainable params']:.1f}%); optimizer state "
                f"{full['optimizer state MiB']} -> {adapted['optimizer state MiB']} MiB; peak "
                f"{full['measured MiB']} -> {adapted['measured MiB']} MiB (predicted {adapted['predicted MiB']}, {adapted['error %']:+.2f}%)",
                "met": adapted["error %"] == 0 and full["error %"] == 0,
            }
            for full, adapted in zip(lora[::2], lora[1::2], strict=True)
        ),
        _int8_target(quantization),
        *_checkpointing_baseline_targets(checkpointing_baselines),
        _torchao_target(torchao),
        _optimizer_target(optimizers),
    ]
    notes = (
        "CPU (one torch thread), memory core (exact tensor bytes). Budget = midway between the full estimates of "
        "bf16-true + adamw and bf16-mixed + adamw, after the planner's 10% margin. Checkpointing 'auto' rows: "
        + "; ".join(
            f"{r['model']}: {r['auto wraps']} blocks wrapped, activations {r['activations MiB']} -> "
            f"{r['with auto MiB']} MiB ({r['activations ratio']}x), peak {r['peak MiB']} -> "
            f"{r['peak with auto MiB']} MiB"
            for r in checkpointing
        )
        + ". LoRA (fp32 + adamw): "
        + "; ".join(
            f"{r['model']}, {r['method']}: {r['trainable params']:,} trainable of {r['total params']:,}, optimizer "
            f"state {r['optimizer state MiB']} MiB, peak {r['measured MiB']} MiB (predicted {r['predicted MiB']})"
            for r in lora
        )
        + "\n\n**int8 conv nets** (trained on digits upsampled to 3 x 16 x 16, test accuracy on 360 held-out images; "
        "size = parameter + buffer bytes; inference peak = a no_grad forward of 64 images):\n\n"
        + markdown(quantization)
        + "\n\n**int8 conv nets: torchao's own recipes beside ours** (the same trained CNNs and test images; 'runs in': "
        "a forward in train mode with grad on, eval, no_grad and inference_mode; conv weight error = relative L2 "
        "distance of the dequantized conv weights from the float ones, mean over the int8 convs; logit error = the "
        "same of the test logits from the float model's):\n\n"
        + markdown(torchao)
        + "\n\n**Checkpointing: Hugging Face's own recipe beside ours** (activations and fwd+bwd peak: one forward + "
        "backward; grads equal: torch.equal to no checkpointing; step peak: the second fp32 + AdamW step, measured, "
        "and predicted by estimate_memory -- for ours from the plain model with activation_checkpointing='auto', for "
        "Hugging Face's from the model after gradient_checkpointing_enable()):\n\n"
        + markdown(checkpointing_baselines)
        + "\n\n**Lean optimizers per model family** (one training step, batch 32 x 3 x 16 x 16; state after it; "
        "'warns': MemoryEfficientOptimizer warns, the lean state being > 0.5x AdamW's):\n\n" + markdown(optimizers)
    )
    # measured on CPU whatever `device` is: the memory core's tensor bytes, which a CUDA run would only round
    return {
        "title": "Vision / torch-native models: planner and checkpointing 'auto' (cpu)",
        "rows": rows,
        "targets": targets,
        "notes": notes,
        "checkpointing": checkpointing,
        "lora": lora,
        "quantization": quantization,
        "optimizers": optimizers,
        "checkpointing_baselines": checkpointing_baselines,
        "torchao": torchao,
    }


def _int8_target(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [row for row in rows if row.get("size ratio") not in (None, "-")]
    ratios = [row["size ratio"] for row in done]
    changes = [row["acc change (points)"] for row in done]
    measured = (
        f"{len(done)} of {len(rows)} quantized; size ratio {min(ratios, default=0):.2f}-{max(ratios, default=0):.2f}x; "
        f"accuracy change {min(changes, default=0):+.1f} to {max(changes, default=0):+.1f} points"
    )
    return {
        "target": "int8 conv nets (weight-only and static) ship >= 3.5x smaller, test accuracy within 1 point",
        "measured": measured,
        "met": len(done) == len(rows) and min(ratios) >= 3.5 and max(abs(c) for c in changes) <= 1.0,
    }


def _checkpointing_baseline_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where Hugging Face's recipe runs: ours no worse than it; where it refuses: ours works. Both: exact estimate."""
    targets = []
    for model in dict.fromkeys(row["model"] for row in rows):
        plain, hf, ours = (row for row in rows if row["model"] == model)
        exact = f"estimate error {ours['error %']:+.2f}% (ours)"
        works = ours["grads equal"] is True and ours["error %"] == 0
        if "error" in hf:
            targets.append(
                {
                    "target": f"{model}: where HF's gradient_checkpointing_enable() refuses, "
                    "checkpointing 'auto' cuts activations with equal gradients and an exact estimate",
                    "measured": f"HF: {hf['error']} Ours: {ours['blocks']} blocks, activations "
                    f"{plain['activations MiB']} -> {ours['activations MiB']} MiB, step peak {plain['step peak MiB']}"
                    f" -> {ours['step peak MiB']} MiB, grads equal {ours['grads equal']}, {exact}",
                    "met": works and ours["activations MiB"] < plain["activations MiB"],
                }
            )
            continue
        targets.append(
            {
                "target": f"{model}: checkpointing 'auto' vs HF's gradient_checkpointing_enable(): "
                "activations and step peak <= HF's, equal gradients, exact estimate on both",
                "measured": f"activations {ours['activations MiB']} vs {hf['activations MiB']} MiB, step peak "
                f"{ours['step peak MiB']} vs {hf['step peak MiB']} MiB (none: {plain['step peak MiB']}), grads equal "
                f"{ours['grads equal']} / {hf['grads equal']}, {exact}, {hf['error %']:+.2f}% (HF's)",
                "met": works
                and hf["error %"] == 0
                and ours["activations MiB"] <= hf["activations MiB"]
                and ours["step peak MiB"] <= hf["step peak MiB"],
            }
        )
    return targets


def _torchao_target(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ours against torchao's only int8 recipe that reaches Conv2d (IntxWeightOnlyConfig on Conv2d + Linear)."""
    ours = [row for row in rows if row["recipe"].startswith("lowmem")]
    theirs = [row for row in rows if row["recipe"].startswith("torchao IntxWeightOnlyConfig")]
    pairs = list(zip(ours, theirs, strict=True))
    measured = "; ".join(
        f"{a['model']}: {a.get('size ratio', '-')}x vs {b.get('size ratio', '-')}x, accuracy change "
        f"{a.get('acc change (points)', '-')} vs {b.get('acc change (points)', '-')} points, logit error "
        f"{a.get('logit error %', '-')}% vs {b.get('logit error %', '-')}%"
        for a, b in pairs
    )
    return {
        "target": "int8 conv nets: our int8_weight_only ships smaller than torchao's IntxWeightOnlyConfig(int8, "
        "PerAxis(0)) on Conv2d + Linear, accuracy within 1 point of float, runs in train/eval/no_grad/inference_mode",
        "measured": measured,
        "met": all(
            a["runs in"] == "all four"
            and a["size ratio"] > b.get("size ratio", 0)
            and abs(a["acc change (points)"]) <= 1
            for a, b in pairs
        ),
    }


def _optimizer_target(rows: list[dict[str, Any]]) -> dict[str, Any]:
    lean = [row for row in rows if row["optimizer"] in ("adamw8bit", "adafactor")]
    right = [row for row in lean if (row["warns"] == "yes") == (row["state vs AdamW"] > 0.5)]
    warned = ", ".join(
        f"{row['family']} / {row['optimizer']} ({row['state vs AdamW']}x)" for row in lean if row["warns"] == "yes"
    )
    return {
        "target": "MemoryEfficientOptimizer warns exactly where 8-bit AdamW / Adafactor keep > 0.5x AdamW's state",
        "measured": f"{len(right)} of {len(lean)} rows right; warned: {warned or 'none'}",
        "met": len(right) == len(lean),
    }
