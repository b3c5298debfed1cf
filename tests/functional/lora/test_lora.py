"""LoRA / QLoRA functional: exact step 0, merge, adapters-only state, fake tensors, HF Conv1D, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem._compat.fake_mode import fake_tensor_mode, is_fake
from lightning_lowmem.demo.charlm import CharGPT, GPTConfig
from lightning_lowmem.functional.lora.adapters import (
    LoraLinear,
    apply_lora_,
    lora_layers,
    merge_lora_,
    merged_state_dict,
    unmerge_lora_,
)
from lightning_lowmem.functional.lora.files import load_adapters, lora_state_dict, save_adapters
from lightning_lowmem.memory import measure_memory, state_bytes

warnings.filterwarnings("ignore", message=".*Enum subclass.*")


def _gpt(n_embd: int = 32, n_layer: int = 2, seed: int = 0) -> CharGPT:
    torch.manual_seed(seed)
    return CharGPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=n_embd, block_size=16))


def _hf_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def _randomise_adapters(module: nn.Module) -> None:
    with torch.no_grad():
        for layer in lora_layers(module).values():
            layer.lora_B.normal_(std=0.05)


TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def test_output_unchanged_at_step_zero_and_only_adapters_trainable(tiny_gpt):
    reference = tiny_gpt(TOKENS)
    report = apply_lora_(tiny_gpt, r=4, alpha=8)
    assert torch.allclose(tiny_gpt(TOKENS), reference)
    assert report.wrapped == [
        f"h.{i}.{n}" for i in range(2) for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    trainable = [name for name, p in tiny_gpt.named_parameters() if p.requires_grad]
    assert trainable and all(name.endswith((".lora_A", ".lora_B")) for name in trainable)
    # 2 blocks x r=4 x (in + out) summed over c_attn (32+96), attn.c_proj (32+32), c_fc (32+128), mlp.c_proj (128+32)
    assert report.trainable_params == 2 * 4 * (128 + 64 + 160 + 160)
    assert "lm_head" not in " ".join(report.wrapped)  # output heads are left out by "all-linear"


def test_merge_equals_unmerged_and_unmerge_restores(tiny_gpt):
    apply_lora_(tiny_gpt, r=4)
    _randomise_adapters(tiny_gpt)
    weight_before = tiny_gpt.h[0].attn.c_attn.weight.detach().clone()
    unmerged = tiny_gpt(TOKENS)
    assert merge_lora_(tiny_gpt) == 8
    assert all(layer.merged for layer in lora_layers(tiny_gpt).values())
    torch.testing.assert_close(tiny_gpt(TOKENS), unmerged, atol=1e-5, rtol=0)
    assert unmerge_lora_(tiny_gpt) == 8
    torch.testing.assert_close(tiny_gpt.h[0].attn.c_attn.weight, weight_before, atol=1e-6, rtol=0)
    torch.testing.assert_close(tiny_gpt(TOKENS), unmerged, atol=1e-5, rtol=0)


def test_backward_reaches_adapters_only(tiny_gpt):
    apply_lora_(tiny_gpt, r=4, target=["c_attn", "mlp.c_fc"])
    F.cross_entropy(tiny_gpt(TOKENS).flatten(0, 1), TOKENS.flatten()).backward()
    with_grad = {name for name, p in tiny_gpt.named_parameters() if p.grad is not None}
    assert with_grad == {
        f"h.{i}.{layer}.lora_{ab}" for i in range(2) for layer in ("attn.c_attn", "mlp.c_fc") for ab in "AB"
    }
    assert tiny_gpt.h[0].attn.c_attn.lora_A.grad.abs().sum() == 0  # B = 0: A gets no signal at step 0
    assert tiny_gpt.h[0].attn.c_attn.lora_B.grad.abs().sum() > 0


def test_hf_gpt2_conv1d_wrap_merge_and_merged_state_dict():
    model = _hf_gpt2()
    reference = model(TOKENS).logits
    report = apply_lora_(model, r=4, target=["c_attn", "c_proj", "c_fc"])
    assert len(report.wrapped) == 8 and all(isinstance(layer, LoraLinear) for layer in lora_layers(model).values())
    layer = model.transformer.h[0].attn.c_attn
    assert layer.fan_in_fan_out and tuple(layer.weight.shape) == (192, 64)  # Conv1D (64, 192) stored as (out, in)
    assert torch.allclose(model(TOKENS).logits, reference)
    _randomise_adapters(model)
    adapted = model(TOKENS).logits
    fresh = _hf_gpt2()
    fresh.load_state_dict(merged_state_dict(model), strict=True)  # original Conv1D layout, no adapter keys
    torch.testing.assert_close(fresh(TOKENS).logits, adapted, atol=1e-5, rtol=0)
    merge_lora_(model)
    torch.testing.assert_close(model(TOKENS).logits, adapted, atol=1e-5, rtol=0)


def test_adapter_state_dict_roundtrip_into_fresh_base(tiny_gpt, tmp_path):
    apply_lora_(tiny_gpt, r=4, alpha=12)
    _randomise_adapters(tiny_gpt)
    expected = tiny_gpt(TOKENS)
    adapters = lora_state_dict(tiny_gpt)
    assert len(adapters) == 16 and all(key.endswith((".lora_A", ".lora_B")) for key in adapters)
    save_adapters(tiny_gpt, tmp_path / "adapters.pt")
    fresh = _gpt()  # same seed: same base weights
    report = load_adapters(fresh, tmp_path / "adapters.pt")
    assert (report.r, report.alpha, len(report.wrapped)) == (4, 12.0, 8)
    torch.testing.assert_close(fresh(TOKENS), expected, atol=0, rtol=0)
    # keys with an extra leading component (a LightningModule's "model.") map onto the inner model too
    prefixed = {f"model.{key}": value for key, value in adapters.items()}
    other = _gpt()
    load_adapters(other, prefixed, alpha=12)
    torch.testing.assert_close(other(TOKENS), expected, atol=0, rtol=0)


def test_apply_lora_under_fake_tensors():
    real = apply_lora_(_gpt(n_embd=64), r=8)
    with fake_tensor_mode() as mode:
        model = CharGPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=16))
        report = apply_lora_(model, r=8)
        layer = model.h[0].attn.c_attn
        assert is_fake(layer.lora_A) and is_fake(layer.weight)
        tokens = mode.from_tensor(TOKENS)
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        assert layer.lora_B.grad is not None and layer.weight.grad is None
        qlora = CharGPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=16))
        apply_lora_(qlora, r=8, quantize_base="int8")  # QLoRA too: int8 storages stay fake
        assert is_fake(qlora.h[1].mlp.c_fc.weight.qdata)
        assert qlora(tokens).shape == (2, 16, 256)
    assert (report.trainable_params, report.total_params) == (real.trainable_params, real.total_params)


def test_lora_model_state_at_most_0_4_of_full_finetuning():
    def model_state_bytes(model: nn.Module) -> int:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        tokens = torch.randint(0, 256, (4, 16))

        def step() -> None:
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            optimizer.step()

        step()  # optimizer state exists from here on
        breakdown = measure_memory(step, module=model, optimizer=optimizer).breakdown
        return breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_state"]

    full = model_state_bytes(_gpt(n_embd=128, n_layer=2))
    lora_model = _gpt(n_embd=128, n_layer=2)
    apply_lora_(lora_model, r=8)
    ratio = model_state_bytes(lora_model) / full
    assert ratio <= 0.4, ratio


def test_qlora_int8_base_quantized_and_at_most_0_3_of_full_parameter_bytes():
    model = CharGPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=16))  # charlm default depth
    full_bytes = state_bytes(model)["parameters"]
    reference = model(TOKENS)
    report = apply_lora_(model, r=8, quantize_base="int8")
    assert report.quantize_base == "int8"
    weight = model.h[0].attn.c_attn.weight
    assert type(weight).__name__ == "Int8Tensor" and not weight.requires_grad
    adapter_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    base_bytes = state_bytes(model)["parameters"] - adapter_bytes
    assert base_bytes <= 0.3 * full_bytes, base_bytes / full_bytes
    assert model.h[0].attn.c_attn.lora_A.dtype == torch.float32  # adapters in training precision
    torch.testing.assert_close(model(TOKENS), reference, atol=0.05, rtol=0)  # int8 rounding only
    model(TOKENS).sum().backward()
    assert model.h[0].attn.c_attn.lora_B.grad is not None
    with pytest.raises(ValueError, match="quantized base weight.*merged_state_dict"):
        merge_lora_(model)
    assert merged_state_dict(model)["h.0.attn.c_attn.weight"].dtype == torch.float32


def test_int4_without_backend_support_wraps_nothing(tiny_gpt):
    reference = tiny_gpt(TOKENS)
    try:
        apply_lora_(_gpt(n_embd=128), quantize_base="int4")
    except RuntimeError:
        pass
    else:
        pytest.skip("this backend supports torchao int4 weight-only")
    with pytest.raises(RuntimeError, match="quantize_base.*'int4' is not supported.*Nothing was wrapped"):
        apply_lora_(tiny_gpt, quantize_base="int4")
    assert not lora_layers(tiny_gpt)
    assert all(p.requires_grad for p in tiny_gpt.parameters())
    assert torch.equal(tiny_gpt(TOKENS), reference)


def test_bad_input(tiny_gpt, tiny_mlp):
    with pytest.raises(ValueError, match=r"pattern 'q_proj' matches no .*layer names are: \[h\.0\.attn\.c_attn"):
        apply_lora_(tiny_gpt, target=["c_attn", "q_proj"])
    assert not lora_layers(tiny_gpt)  # nothing wrapped when one pattern fails
    with pytest.raises(ValueError, match=r"`r` \(adapter rank\) must be an int > 0, got 0"):
        apply_lora_(tiny_gpt, r=0)
    with pytest.raises(ValueError, match="`r`.*got 2.5"):
        apply_lora_(tiny_gpt, r=2.5)
    with pytest.raises(ValueError, match="`alpha` must be a number > 0, got -1"):
        apply_lora_(tiny_gpt, alpha=-1)
    with pytest.raises(ValueError, match=r"`dropout` must be in \[0, 1\), got 1.5"):
        apply_lora_(tiny_gpt, dropout=1.5)
    with pytest.raises(ValueError, match="`quantize_base` must be one of .*got 'nf4'"):
        apply_lora_(tiny_gpt, quantize_base="nf4")
    with pytest.raises(TypeError, match="`target` entries must be .*got int"):
        apply_lora_(tiny_gpt, target=[3])
    with pytest.raises(ValueError, match="found no linear layer in _HeadOnly"):
        apply_lora_(_HeadOnly(), target="all-linear")
    apply_lora_(tiny_mlp, target=[nn.Linear])
    assert len(lora_layers(tiny_mlp)) == 3
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora_(tiny_mlp)
    with pytest.raises(ValueError, match="holds no adapter tensors"):
        load_adapters(_gpt(), {"h.0.attn.c_attn.weight": torch.zeros(1)})


class _HeadOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(4, 4)


def test_quantize_frozen_also_stores_head_and_embeddings_in_int8():
    """charlm 4x128: QLoRA alone leaves ~16% of the bytes (embeddings, lm_head) in fp32; with them int8
    the frozen base is at most 0.3x of the full model's parameter bytes, and training still reaches the adapters."""
    model = CharGPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=16))
    full_bytes = state_bytes(model)["parameters"]
    reference = model(TOKENS)
    apply_lora_(model, r=8, quantize_base="int8", quantize_frozen=True)
    for name in ("wte", "wpe", "lm_head"):
        weight = getattr(model, name).weight
        assert type(weight) is not torch.nn.Parameter and not weight.requires_grad, name
    adapter_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    base_bytes = state_bytes(model)["parameters"] - adapter_bytes
    assert base_bytes <= 0.3 * full_bytes, base_bytes / full_bytes
    torch.testing.assert_close(model(TOKENS), reference, atol=0.08, rtol=0)
    model(TOKENS).sum().backward()
    assert model.h[0].attn.c_attn.lora_A.grad is not None
    with pytest.raises(ValueError, match="`quantize_frozen`=True needs `quantize_base`"):
        apply_lora_(CharGPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)), quantize_frozen=True)


def test_quantize_frozen_leaves_tied_weights_float():
    model = CharGPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    model.lm_head.weight = model.wte.weight  # tied, as GPT-2
    apply_lora_(model, r=4, quantize_base="int8", quantize_frozen=True)
    assert model.lm_head.weight is model.wte.weight and type(model.wte.weight) is torch.nn.Parameter
    assert type(model.wpe.weight) is not torch.nn.Parameter  # unshared: quantized


def test_lora_on_a_model_quantized_with_quantize_():
    """A model shipped in int8 (torchao ``Int8Tensor`` weights) takes adapters: it used to fail in
    ``LoraLinear.__init__`` (``aten.new_empty`` is not implemented for ``Int8Tensor``)."""
    from lightning_lowmem.functional.quantization.ptq import quantize_

    model = _gpt()
    quantize_(model, "int8_weight_only", embeddings=False)
    reference = model(TOKENS)
    report = apply_lora_(model, r=4)
    assert len(report.wrapped) == 8
    layer = lora_layers(model)["h.0.attn.c_attn"]
    assert type(layer.weight).__name__ == "Int8Tensor" and layer.lora_A.dtype == torch.float32
    assert torch.equal(model(TOKENS), reference)  # B = 0: exact at step 0
    model(TOKENS).sum().backward()
    assert layer.lora_B.grad.abs().sum() > 0 and not layer.lora_A.grad.any()  # B = 0: only B moves first
