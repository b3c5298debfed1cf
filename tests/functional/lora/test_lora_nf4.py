"""QLoRA's own 4-bit type, NF4 (torchao's ``NF4Tensor``), on CPU: forward and backward against the dequantized
float model, the frozen quantized linears of ``quantize_frozen`` keeping only the quantized weight for backward,
the base keeping its format through ``module.to(dtype)``, int4 refused on CPU in one line, and the estimate
(``estimate_memory(lora={"quantize_base": "nf4"})``) equal to the measured step on CPU and running for CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.lora.adapters import apply_lora_, lora_layers, merged_state_dict
from lightning_lowmem.functional.lora.quantized_base import (
    FrozenQuantizedLinear,
    dequantized,
    is_nf4,
    nf4_blocks,
)
from lightning_lowmem.memory import measure_memory
from lightning_lowmem.planning.estimate import estimate_memory

WIDTH = 512


def _model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH)]
    return nn.Sequential(*layers).to(dtype)


def _qlora(quantize_base: str | None, quantize_frozen: bool = False, dtype: torch.dtype = torch.float32):
    model = _model(dtype)
    apply_lora_(model, r=4, target=["0"], quantize_base=quantize_base, quantize_frozen=quantize_frozen)
    torch.manual_seed(1)
    for layer in lora_layers(model).values():
        nn.init.normal_(layer.lora_B, std=0.02)  # B != 0: the adapter gets a gradient through the frozen layers
    return model


def test_nf4_base_is_4_bit_and_gradients_equal_the_dequantized_float_model():
    model = _qlora("nf4", quantize_frozen=True)
    weights = [model[i].weight for i in (0, 2, 4)]
    assert all(is_nf4(w) for w in weights) and isinstance(model[2], FrozenQuantizedLinear)
    stored = sum(getattr(w, name).untyped_storage().nbytes() for w in weights for name in w.__tensor_flatten__()[0])
    assert stored < 3 * WIDTH * WIDTH * 4 / 7  # 4 bits + double-quantized scales: ~0.52 byte a weight vs 4
    reference = copy.deepcopy(model)
    for i in (0, 2, 4):
        reference[i].weight = nn.Parameter(dequantized(reference[i].weight), requires_grad=False)
    assert not is_nf4(reference[2].weight)
    x = torch.randn(8, WIDTH)
    model(x).square().mean().backward()
    reference(x).square().mean().backward()
    for name in ("0.lora_A", "0.lora_B"):
        got, want = model.get_parameter(name).grad, reference.get_parameter(name).grad
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("quantize_base", ["int8", "nf4"])
def test_frozen_quantized_linears_save_no_float_copy_for_backward(quantize_base):
    """Layers 2 and 4 get no adapter; their input needs a gradient (the adapter of layer 0 is before them)."""

    def activations(model: nn.Module) -> int:
        x = torch.randn(16, WIDTH)

        def step() -> None:
            model(x).square().mean().backward()

        step()
        return measure_memory(step, module=model, device="cpu").breakdown["activations"]

    plain, quantized = activations(_qlora(None)), activations(_qlora(quantize_base, quantize_frozen=True))
    # a saved float copy of the two frozen weights would be 2 * 512 * 512 * 4 B = 2 MiB more
    assert quantized <= plain + 64 * 1024, (quantize_base, quantized, plain)


def test_a_quantized_base_keeps_its_format_and_dtype_through_module_to():
    """Lightning's precision plugin converts the model (``module.to(dtype=...)``) after the callbacks' setup;
    torchao's ``NF4Tensor.to(dtype)`` would dequantize."""
    model = _qlora("nf4", quantize_frozen=True, dtype=torch.bfloat16)
    before = {name: model[i].weight for i, name in ((0, "0"), (2, "2"))}
    model.to(dtype=torch.bfloat16)
    model.float()
    assert model[0].weight is before["0"] and model[2].weight is before["2"]
    assert is_nf4(model[0].weight) and model[0].weight.dtype == torch.bfloat16
    assert model[0].lora_A.dtype == torch.float32 and model[0].bias.dtype == torch.float32  # the rest converts


def test_int4_on_cpu_is_refused_in_one_line():
    model = _model()
    with pytest.raises(
        RuntimeError, match=r"^`quantize_base`='int4' runs on CUDA only .*'cpu'.*quantize_base='nf4'"
    ) as err:
        apply_lora_(model, r=4, target=["0"], quantize_base="int4")
    assert "\n" not in str(err.value) and not lora_layers(model)


def test_nf4_needs_weights_in_whole_blocks():
    assert nf4_blocks(WIDTH * WIDTH) == (64, 256) and nf4_blocks(64 * 64) == (64, 64) and nf4_blocks(100) is None
    model = nn.Sequential(nn.Linear(30, 10))
    with pytest.raises(ValueError, match=r"`quantize_base`='nf4' needs weights whose size is a multiple of 64"):
        apply_lora_(model, r=2, target=["0"], quantize_base="nf4")


def test_merged_state_dict_of_an_nf4_model_is_float_and_loads_into_the_plain_model():
    model = _qlora("nf4", quantize_frozen=True)
    state = merged_state_dict(model)
    assert all(not is_nf4(value) for value in state.values())
    plain = _model()
    plain.load_state_dict(state, strict=True)
    x = torch.randn(4, WIDTH)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("quantize_base", ["int8", "nf4"])
def test_qlora_estimate_equals_the_measured_step_on_cpu(quantize_base):
    from lightning_lowmem.functional.config import TrainingConfig
    from lightning_lowmem.functional.optimizers.catalog import build_optimizer
    from lightning_lowmem.planning.estimate import _train_step

    lora = {"r": 4, "target": ["0"], "quantize_base": quantize_base, "quantize_frozen": True}
    batch = (torch.randn(16, WIDTH), torch.randn(16, WIDTH))
    loss = lambda module, batch: (module(batch[0]) - batch[1]).square().mean()  # noqa: E731
    estimate = estimate_memory(
        _model(torch.bfloat16), batch, loss_fn=loss, device="cpu", precision="bf16-true", lora=lora
    )
    model = _model(torch.bfloat16)
    apply_lora_(model, **lora)
    config = TrainingConfig(precision="bf16-true", lora=lora)
    optimizer = build_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    real = tuple(t.bfloat16() for t in batch)
    _train_step(model, real, loss, optimizer, config, None, loop="torch")
    measured = measure_memory(_train_step, model, real, loss, optimizer, config, None, loop="torch", module=model)
    assert estimate.peak_bytes == measured.peak_bytes, (quantize_base, estimate.breakdown, measured.breakdown)
    on_cuda = dict(loss_fn=loss, device="cuda", precision="bf16-true")
    cuda = estimate_memory(_model(torch.bfloat16), batch, lora=lora, **on_cuda).breakdown["parameters"]
    plain = estimate_memory(_model(torch.bfloat16), batch, lora={"r": 4, "target": ["0"]}, **on_cuda)
    assert cuda < plain.breakdown["parameters"] * {"int8": 0.55, "nf4": 0.3}[quantize_base]  # 1 B / ~0.52 B vs 2 B
