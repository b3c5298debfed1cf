"""int8 quantization of conv nets (#25): Conv2d weights in the in-place int8 modes, int8_static's errors and
fallback on models pt2e cannot take. Models from ``tests/vision_zoo.py``."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.quantization import (
    StaticQuantizationError,
    dequantize_,
    quantize_,
)
from lightning_lowmem.memory.measure import state_bytes
from lightning_lowmem.warnings import LowMemWarning
from tests.vision_zoo import hf_resnet, image_batch, staged_cnn

pytest.importorskip("torchao")


def logits(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    output = model(images)
    return getattr(output, "logits", output)


@torch.no_grad()
def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return float((output - reference).norm() / reference.norm())  # (B, classes)


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


def torchvision_style_resnet(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, width, 7, 2, 3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
        SharedReluBlock(width),
        SharedReluBlock(width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    )


class CausalSeq2Seq(nn.Module):
    """Lightning's demo ``Transformer``: ``nn.Transformer`` called with a causal ``tgt_mask``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.transformer = nn.Transformer(32, 2, 1, 1, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, C)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.transformer(x, x, tgt_mask=mask).mean(dim=1))


@pytest.mark.parametrize(("make", "min_ratio"), [(hf_resnet, 3.6), (staged_cnn, 3.5)])
@pytest.mark.parametrize("mode", ["int8_weight_only", "int8_dynamic"])
def test_int8_covers_conv2d_and_ships_cnns_3_5x_smaller(make, min_ratio, mode):
    model = make().eval()
    images, _ = image_batch()
    reference = logits(model, images)
    float_model = copy.deepcopy(model)
    bytes_before = state_bytes(model)["parameters"]
    report = quantize_(model, mode)
    convs = [name for name, layer in model.named_modules() if isinstance(layer, nn.Conv2d)]
    assert set(convs) <= set(report.converted) and convs
    assert all(model.get_submodule(name).weight.qdata.dtype == torch.int8 for name in convs)
    assert all(tuple(model.get_submodule(name).weight.scale.shape[1:]) == (1, 1, 1) for name in convs)  # per channel
    ratio = bytes_before / state_bytes(model)["parameters"]
    assert ratio >= min_ratio and report.size_ratio == pytest.approx(ratio)
    assert relative_error(logits(model, images), reference) < 0.02
    with torch.no_grad():  # runs in eval / no_grad / train, not only under inference_mode
        assert relative_error(logits(model, images), reference) < 0.02
    float_model.train(), model.train()  # BatchNorm on batch statistics, in both
    assert relative_error(logits(model, images), logits(float_model, images)) < 0.02


def test_quantized_cnn_state_dict_round_trip_and_dequantize():
    model = hf_resnet().eval()
    images, _ = image_batch()
    quantize_(model, "int8_weight_only")
    expected = logits(model, images)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, map_location=lambda storage, location: storage, weights_only=True)  # Lightning's way
    conv_weight = state["resnet.embedder.embedder.convolution.weight"]
    assert type(conv_weight).__name__ == "IntxUnpackedToInt8Tensor"
    from lightning_lowmem.checkpoints.quantized import prepare_for_load

    fresh = hf_resnet(seed=1).eval()
    taken, _ = prepare_for_load(fresh, state)
    assert "resnet.embedder.embedder.convolution" in taken
    fresh.load_state_dict(state)
    assert torch.equal(logits(fresh, images), expected)
    assert "resnet.embedder.embedder.convolution" in dequantize_(fresh)
    assert type(fresh.resnet.embedder.embedder.convolution.weight) is nn.Parameter


def test_int4_modes_leave_conv2d_float_and_say_so():
    with pytest.warns(LowMemWarning, match="Conv2d .* of .* parameter bytes|float parameters remain in: Conv2d"):
        report = quantize_(staged_cnn(), "intx4_weight_only", group_size=16)
    assert report.converted == ["fc"]


def test_int8_static_takes_torchvisions_shared_relu_block():
    model = torchvision_style_resnet().eval()
    images, _ = image_batch()
    reference = model(images)
    report = quantize_(model, "int8_static", calibration_data=[(images,)])  # was: "more than one output node"
    assert len(report.converted) == 6 and report.size_ratio > 3.5
    assert relative_error(report.module(images), reference) < 0.05


def test_int8_static_export_failure_is_clear_and_falls_back():
    from tests.vision_zoo import token_batch

    tokens, _ = token_batch()
    with pytest.raises(
        StaticQuantizationError, match=r"could not export CausalSeq2Seq .*tgt_is_causal=True.*int8_weight_only"
    ):
        quantize_(CausalSeq2Seq(), "int8_static", calibration_data=[(tokens,)])
    model = CausalSeq2Seq()
    with pytest.warns(LowMemWarning, match="Falling back to mode='int8_weight_only'"):
        report = quantize_(model, "int8_static", calibration_data=[(tokens,)], fallback="int8_weight_only")
    assert report.mode == "int8_weight_only" and report.module is model and "head" in report.converted
    with pytest.raises(ValueError, match="`fallback`=.int8_static. must be an in-place mode"):
        quantize_(CausalSeq2Seq(), "int8_static", calibration_data=[(tokens,)], fallback="int8_static")
