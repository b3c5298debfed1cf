"""QLoRA with an int4 base on CUDA (torchao's tinygemm format): it stores the base in about a sixth of the
fp32 bytes, computes what the float model computes, and trains. GPU only (``cuda`` marker)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.lora.adapters import apply_lora_
from lightning_lowmem.memory import state_bytes

pytestmark = pytest.mark.cuda


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return (
        nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024))
        .cuda()
        .to(dtype)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qlora_int4_base_is_small_close_and_trains(dtype):
    model = _model(dtype)
    x = torch.randn(256, 1024, device="cuda", dtype=dtype)
    with torch.no_grad():
        reference = model(x).float()
    # what fine-tuning should learn: the float model's output plus a rank-4 change, which adapters can fit
    low_rank = torch.randn(1024, 4, device="cuda") @ torch.randn(4, 1024, device="cuda") / 32
    target = reference + x.float() @ low_rank
    full = state_bytes(model)["parameters"]
    report = apply_lora_(model, r=8, alpha=16, target=["0", "2", "4"], quantize_base="int4")
    assert report.wrapped == ["0", "2", "4"]
    adapters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    base = state_bytes(model)["parameters"] - adapters
    # 4 bits + a bf16 scale and zero per group: 0.625 B a weight, against 4 B (fp32: ~0.16x) or 2 B (bf16: ~0.31x)
    assert base <= (0.2 if dtype == torch.float32 else 0.35) * full, (base, full)
    with torch.no_grad():
        start = model(x).float()  # the adapters start at B = 0: the quantized base alone
    assert 1e-3 < ((start - reference).norm() / reference.norm()).item() < 0.25  # int4: ~7% a layer, three layers

    frozen = [layer.weight for layer in (model[0], model[2], model[4])]

    def inner(weight: torch.Tensor) -> list[torch.Tensor]:
        return [getattr(weight, name).clone() for name in weight.__tensor_flatten__()[0]]

    snapshot = [inner(w) for w in frozen]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(30):
        loss = nn.functional.mse_loss(model(x).float(), target)
        loss.backward()  # through the frozen int4 bases: their input gradients reach the first adapters
        assert model[0].lora_B.grad is not None and model[0].lora_B.grad.abs().sum() > 0  # came back through 2 bases
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    for weight, before in zip(frozen, snapshot, strict=True):  # the packed base never changed
        assert all(torch.equal(a, b) for a, b in zip(inner(weight), before, strict=True))
