"""int4 weight-only quantization on CUDA (torchao's tinygemm packing, bf16). GPU only (``cuda`` marker)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.quantization.ptq import available_modes, quantize_

pytestmark = pytest.mark.cuda


def _wide_bf16() -> nn.Module:
    # in_features 1024: tinygemm pads in_features to a multiple of 1024, so this width stores no padding
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024)).cuda().to(torch.bfloat16)


def test_int4_weight_only_is_available_on_cuda():
    assert "int4_weight_only" in available_modes("cuda")


def test_int4_weight_only_packs_and_stays_close():
    model = _wide_bf16()
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference = model(x).float()
    report = quantize_(model, "int4_weight_only", group_size=32)
    assert report.converted == ["0", "2"]
    assert all("int4" in type(model[i].weight).__name__.lower() for i in (0, 2))
    # bf16 (2 B) -> 4 bits + a bf16 scale and zero per 32 weights (0.625 B): >= 3x with the bf16 biases
    assert report.size_ratio >= 3.0, report
    with torch.no_grad():
        out = model(x).float()
    change = ((out - reference).norm() / reference.norm()).item()
    assert 1e-3 < change < 0.2, change  # quantized for real (int4: ~6% a layer here), still the same function


def test_int4_weight_only_on_float32_weights_is_a_clear_error():
    model = nn.Sequential(nn.Linear(256, 256)).cuda()  # float32: torchao's int4 packing would assert
    with pytest.raises(ValueError, match=r"quantizes bfloat16 weights; Sequential has \['torch.float32'\]"):
        quantize_(model, "int4_weight_only")
