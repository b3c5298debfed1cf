"""QLoRA's frozen quantized base in backward (``_lora_quantization.frozen_linear``): the input gradient
comes from a transient dequantized weight, so no float copy of any base weight is kept from forward to
backward, and the gradients equal those of the dequantized float model. CPU, int8 base (int4 on CUDA:
``test_lora_cuda.py``)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_lowmem.functional.lora.quantized_base import dequantized, frozen_linear
from lightning_lowmem.functional.lora.adapters import apply_lora_, lora_layers
from lightning_lowmem.memory import measure_memory

TARGETS = ["0", "2", "4"]


def _model(quantize_base: str | None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 256))
    apply_lora_(model, r=4, alpha=8, target=TARGETS, quantize_base=quantize_base)
    torch.manual_seed(1)
    for layer in lora_layers(model).values():
        nn.init.normal_(layer.lora_B, std=0.02)  # B != 0: every adapter gets a gradient
    return model


def _activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    def step() -> None:
        model(x).square().mean().backward()

    step()
    model.zero_grad(set_to_none=True)
    return measure_memory(step, module=model, device="cpu").breakdown["activations"]


def test_qlora_backward_keeps_no_float_copy_of_the_base_weights():
    x = torch.randn(32, 256)
    plain = _activation_bytes(_model(None), x)
    quantized = _activation_bytes(_model("int8"), x)
    # torchao's int8 weight-only linear saves the weight cast to float for backward: 512*512*4 + 256*512*4 B
    # for the two layers whose input needs a gradient, on top of what a float LoRA model saves
    assert quantized <= plain + 16 * 1024, (quantized, plain)


def test_qlora_gradients_equal_the_dequantized_float_model():
    model = _model("int8")
    reference = copy.deepcopy(model)
    for layer in lora_layers(reference).values():
        layer.weight = nn.Parameter(dequantized(layer.weight), requires_grad=False)
    x = torch.randn(32, 256, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    model(x).square().mean().backward()
    reference(x_ref).square().mean().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-7)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if got.requires_grad:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_frozen_linear_is_plain_linear_when_nothing_needs_a_gradient():
    layer = _model("int8")[2]
    x = torch.randn(4, 512)
    with torch.no_grad():
        assert frozen_linear(x, layer.weight, layer.bias).grad_fn is None
    out = frozen_linear(x.requires_grad_(), layer.weight, layer.bias)
    assert type(out.grad_fn).__name__ == "_FrozenQuantizedLinearBackward"
    torch.testing.assert_close(out, nn.functional.linear(x, layer.weight, layer.bias))
