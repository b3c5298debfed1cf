"""The vision / torch-native model zoo of the tests: models users bring that are not Hugging Face text models.

Tiny, randomly initialised, no downloads: Hugging Face ResNet, ViT, ConvNeXt and MobileNetV2 built from configs, a flat ``nn.Sequential``
CNN (no repeated block anywhere), a CNN whose blocks sit in ``nn.Sequential`` stages of stages (torchvision's
layout: ``model.layer1[0]`` ...), an ``nn.TransformerEncoder`` classifier (``nn.MultiheadAttention`` inside) and a
whole ``nn.Transformer``. Each takes an ``(images or tokens, labels)`` batch; :func:`image_batch` /
:func:`token_batch` make one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

__all__ = [
    "MHAClassifier",
    "TransformerSeq2Seq",
    "hf_convnext",
    "hf_mobilenet_v2",
    "hf_resnet",
    "mha_classifier",
    "hf_vit",
    "calibrate_batchnorm",
    "image_batch",
    "sequential_cnn",
    "staged_cnn",
    "token_batch",
    "transformer_seq2seq",
]

NUM_CLASSES = 10


def image_batch(batch_size: int = 8, size: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images (B, 3, size, size), labels (B,))``."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, size, size, generator=generator)
    return images, torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)


def token_batch(
    batch_size: int = 4, length: int = 12, vocab: int = 50, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens (B, T), labels (B,))``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size, length), generator=generator)
    return tokens, torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)


def hf_resnet(hidden_sizes: tuple[int, ...] = (16, 32), depths: tuple[int, ...] = (2, 2), seed: int = 0) -> nn.Module:
    """A tiny Hugging Face ``ResNetForImageClassification`` (basic blocks; stages in an ``nn.ModuleList``, the
    blocks of a stage in an ``nn.Sequential``)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.ResNetConfig(
        num_channels=3,
        embedding_size=16,
        hidden_sizes=list(hidden_sizes),
        depths=list(depths),
        layer_type="basic",
        num_labels=NUM_CLASSES,
    )
    return transformers.ResNetForImageClassification(config)


def hf_vit(layers: int = 2, seed: int = 0) -> nn.Module:
    """A tiny Hugging Face ``ViTForImageClassification`` (32 x 32 images, 8 x 8 patches, width 32)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=NUM_CLASSES,
    )
    return transformers.ViTForImageClassification(config)


def hf_convnext(hidden_sizes: tuple[int, ...] = (32, 64), depths: tuple[int, ...] = (2, 2), seed: int = 0) -> nn.Module:
    """A tiny Hugging Face ``ConvNextForImageClassification`` (32 x 32 images, 2 x 2 patches): ``ConvNextLayer``
    blocks (a depthwise 7 x 7 ``Conv2d``, LayerNorm, two ``nn.Linear`` and a layer scale) in an ``nn.ModuleList``
    per stage, the stages in another."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.ConvNextConfig(
        num_channels=3,
        patch_size=2,
        hidden_sizes=list(hidden_sizes),
        depths=list(depths),
        num_stages=len(depths),
        image_size=32,
        num_labels=NUM_CLASSES,
    )
    return transformers.ConvNextForImageClassification(config)


def hf_mobilenet_v2(depth_multiplier: float = 0.25, seed: int = 0) -> nn.Module:
    """A tiny Hugging Face ``MobileNetV2ForImageClassification``: its 16 ``MobileNetV2InvertedResidual`` blocks
    (1 x 1 expand, depthwise 3 x 3, 1 x 1 reduce, each ``Conv2d`` + ``BatchNorm2d``) in an ``nn.ModuleList``,
    channels scaled by ``depth_multiplier`` (0.25: 74k parameters; 1.0: MobileNetV2's own 2.2M), no dropout.

    Random weights (std 0.02) shrink the signal ~10^-29 through 17 conv layers in eval mode, where BatchNorm's
    running statistics are still 0 / 1: run one training-mode forward first (HF's BatchNorm momentum is 0.997,
    so one batch sets them), as :func:`calibrate_batchnorm` does.
    """
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.MobileNetV2Config(
        num_channels=3,
        image_size=32,
        depth_multiplier=depth_multiplier,
        depth_divisible_by=4 if depth_multiplier < 1 else 8,
        min_depth=4 if depth_multiplier < 1 else 8,
        expand_ratio=2.0 if depth_multiplier < 1 else 6.0,
        finegrained_output=False,
        classifier_dropout_prob=0.0,
        num_labels=NUM_CLASSES,
    )
    return transformers.MobileNetV2ForImageClassification(config)


@torch.no_grad()
def calibrate_batchnorm(model: nn.Module, images: torch.Tensor) -> nn.Module:
    """Set BatchNorm's running statistics from ``images`` (one training-mode forward), return ``model`` in eval."""
    model.train()(images)
    return model.eval()


def sequential_cnn(width: int = 16, seed: int = 0) -> nn.Sequential:
    """A flat ``nn.Sequential`` CNN: convolutions and activations side by side, no repeated block."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, NUM_CLASSES),
    )


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn + identity, as torchvision's ``BasicBlock``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


class StagedCNN(nn.Module):
    """torchvision's ResNet layout: ``stem``, then ``layer1`` / ``layer2`` -- ``nn.Sequential`` attributes (not in any
    ``nn.ModuleList``) of :class:`BasicBlock` s -- then a head."""

    def __init__(self, width: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = nn.Sequential(*(BasicBlock(width) for _ in range(blocks)))
        self.layer2 = nn.Sequential(*(BasicBlock(width) for _ in range(blocks)))
        self.fc = nn.Linear(width, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))  # (B, C, H, W)
        return self.fc(x.mean(dim=(2, 3)))


def staged_cnn(width: int = 16, blocks: int = 2, seed: int = 0) -> StagedCNN:
    torch.manual_seed(seed)
    return StagedCNN(width, blocks)


class MHAClassifier(nn.Module):
    """Embedding -> ``nn.TransformerEncoder`` (``nn.MultiheadAttention`` in each layer) -> mean -> ``head``."""

    def __init__(self, vocab: int = 50, width: int = 32, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))  # (B, T, C) -> (B, classes)


class TransformerSeq2Seq(nn.Module):
    """A whole ``nn.Transformer`` (encoder and decoder layers), classifying the pooled decoder output."""

    def __init__(self, vocab: int = 50, width: int = 32, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.transformer = nn.Transformer(
            width, heads, layers, layers, dim_feedforward=2 * width, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(width, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, C)
        return self.head(self.transformer(x, x).mean(dim=1))


def mha_classifier(seed: int = 0, **kwargs: int) -> MHAClassifier:
    torch.manual_seed(seed)
    return MHAClassifier(**kwargs)


def transformer_seq2seq(seed: int = 0, **kwargs: int) -> TransformerSeq2Seq:
    torch.manual_seed(seed)
    return TransformerSeq2Seq(**kwargs)
