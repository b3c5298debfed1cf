"""The int8 and optimizer rows of ``bench_vision``: conv nets trained on digits, quantized with int8 (size ratio from
bytes, test-accuracy change, inference peaks), and each lean optimizer's state and step peak per model family.

Digits (scikit-learn's 8 x 8 images, no download) are repeated to 3 channels and upsampled to 16 x 16 so the
vision models take them; each CNN trains briefly with AdamW from a fixed seed, then is quantized. Memory is the
memory core's (exact tensor bytes, CPU).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.common import mib
from lightning_lowmem.demo.digits import load_digits_tensors
from lightning_lowmem.functional.optimizers.catalog import build_optimizer
from lightning_lowmem.functional.optimizers.savings import lean_optimizer_warning
from lightning_lowmem.functional.quantization import StaticQuantizationError, quantize_
from lightning_lowmem.memory import measure_memory, state_bytes

OPTIMIZERS = ["adamw", "adamw8bit", "adafactor", "adamw_in_backward"]


def hf_resnet(
    layer_type: str = "basic", sizes: tuple[int, int] = (16, 32), depths: tuple[int, int] = (2, 2)
) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(
        num_channels=3,
        embedding_size=16,
        hidden_sizes=list(sizes),
        depths=list(depths),
        layer_type=layer_type,
        num_labels=10,
    )
    return ResNetForImageClassification(config)


class SharedReluBlock(nn.Module):
    """torchvision's ``BasicBlock``: one ``nn.ReLU(inplace=True)`` called twice, ``out += identity``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += x
        return self.relu(out)


def torchvision_style_resnet(width: int = 32) -> nn.Module:
    """A stride-2 stem (as ResNet-18's), then two shared-ReLU blocks and a head."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 2, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        SharedReluBlock(width),
        SharedReluBlock(width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    )


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
    )
    return ViTForImageClassification(config)


class MHAClassifier(nn.Module):
    """Image patches -> ``nn.TransformerEncoder`` (``nn.MultiheadAttention`` inside) -> mean -> head."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patches = nn.Linear(3 * 4 * 4, width)
        layer = nn.TransformerEncoderLayer(width, 4, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = (
            images.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)
        )  # (B, 16, 48)
        return self.head(self.encoder(self.patches(patches)).mean(dim=1))


def digits(small: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    images, labels = load_digits_tensors()
    images = nn.functional.interpolate(images.repeat(1, 3, 1, 1), size=16, mode="bilinear", align_corners=False)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    images, labels = images[order], labels[order]
    test = 360
    train = 512 if small else len(labels) - test
    return {"train": (images[test : test + train], labels[test : test + train]), "test": (images[:test], labels[:test])}


def _logits(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    output = model(images)
    return getattr(output, "logits", output)


def train(model: nn.Module, data: dict[str, Any], steps: int) -> nn.Module:
    images, labels = data["train"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        index = torch.randint(0, len(labels), (64,), generator=generator)
        loss = nn.functional.cross_entropy(_logits(model, images[index]), labels[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, data: dict[str, Any]) -> float:
    images, labels = data["test"]
    return float((_logits(model, images).argmax(-1) == labels).float().mean())


def inference_peak(model: nn.Module, images: torch.Tensor) -> int:
    def forward() -> None:
        with torch.no_grad():
            model(images)

    return measure_memory(forward, module=model).peak_bytes


def trained_cnns(small: bool) -> tuple[dict[str, Any], list[tuple[str, nn.Module]]]:
    """The digits data and the two CNNs trained on it (eval mode) that the int8 rows quantize."""
    data = digits(small)
    steps = 20 if small else 60
    models: list[tuple[str, Callable[[], nn.Module]]] = [
        ("HF ResNet (basic, 16/32)", hf_resnet),
        ("torchvision-style ResNet (shared ReLU)", torchvision_style_resnet),
    ]
    return data, [(name, train(make(), data, steps)) for name, make in models]


def quantization_rows(data: dict[str, Any], cnns: list[tuple[str, nn.Module]]) -> list[dict[str, Any]]:
    """One row per (CNN, int8 mode): size float -> int8 (bytes), test accuracy float -> int8, inference peaks."""
    rows = []
    images = data["test"][0][:64]
    for name, trained in cnns:
        float_accuracy, float_bytes = accuracy(trained, data), state_bytes(trained)["parameters"]
        float_peak = inference_peak(trained, images)
        for mode in ("int8_weight_only", "int8_static"):
            model = copy.deepcopy(trained)
            row: dict[str, Any] = {"model": name, "mode": mode, "float KiB": round(float_bytes / 1024, 1)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    calibration = [(data["train"][0][i : i + 64],) for i in range(0, 256, 64)]
                    report = quantize_(model, mode, calibration_data=calibration if mode == "int8_static" else None)
                except StaticQuantizationError as error:
                    rows.append({**row, "int8 KiB": "-", "size ratio": "-", "error": str(error).split(":")[1][:80]})
                    continue
            quantized = report.module
            quantized_bytes = state_bytes(quantized)["parameters"]
            quantized_accuracy = accuracy(quantized, data)
            rows.append(
                {
                    **row,
                    "int8 KiB": round(quantized_bytes / 1024, 1),
                    "size ratio": round(float_bytes / quantized_bytes, 2),
                    "layers": len(report.converted),
                    "float acc %": round(100 * float_accuracy, 1),
                    "int8 acc %": round(100 * quantized_accuracy, 1),
                    "acc change (points)": round(100 * (quantized_accuracy - float_accuracy), 1),
                    "inference peak float MiB": mib(float_peak),
                    "inference peak int8 MiB": mib(inference_peak(quantized, images)),
                }
            )
    return rows


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    loss = nn.functional.cross_entropy(_logits(model, batch[0]), batch[1])
    loss.backward()
    if type(optimizer).__name__ != "OptimizerInBackward":  # in backward: the step ran inside backward
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def optimizer_rows(small: bool) -> list[dict[str, Any]]:
    """Per model family and lean optimizer: measured state and train-step peak, vs fp32 AdamW, and whether
    ``MemoryEfficientOptimizer`` warns."""
    families: list[tuple[str, Callable[[], nn.Module]]] = [
        ("HF ResNet basic (3x3 convs)", hf_resnet),
        ("HF ResNet bottleneck (1x1 convs)", lambda: hf_resnet("bottleneck", (64, 128), (1, 1))),
        ("torchvision-style ResNet, width 16 (convs of 2304 weights)", lambda: torchvision_style_resnet(16)),
        ("torchvision-style ResNet, width 32", torchvision_style_resnet),
        ("HF ViT (width 64)", vit),
        ("nn.TransformerEncoder (width 64)", MHAClassifier),
    ]
    generator = torch.Generator().manual_seed(0)
    batch = (
        torch.randn(8 if small else 32, 3, 16, 16, generator=generator),
        torch.randint(0, 10, (8 if small else 32,), generator=generator),
    )
    rows = []
    for family, make in families:
        baseline: dict[str, int] = {}
        for name in OPTIMIZERS:
            model = make()
            optimizer = build_optimizer(name, model.parameters(), lr=1e-3)

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _train_step(model, optimizer, batch)  # creates the state
                peak = measure_memory(
                    _train_step, model, optimizer, batch, module=model, optimizer=optimizer
                ).peak_bytes
            state = state_bytes(model, [optimizer])["optimizer_state"]
            baseline = baseline or {"state": state, "peak": peak}
            rows.append(
                {
                    "family": family,
                    "optimizer": name,
                    "params MiB": mib(state_bytes(model)["parameters"]),
                    "state MiB": mib(state),
                    "state vs AdamW": round(state / baseline["state"], 3),
                    "step peak MiB": mib(peak),
                    "peak vs AdamW %": round(100 * (peak / baseline["peak"] - 1), 1),
                    "warns": "yes" if lean_optimizer_warning(name, model.parameters()) else "no",
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """``rows`` as a Markdown table (columns in first-seen order)."""
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
