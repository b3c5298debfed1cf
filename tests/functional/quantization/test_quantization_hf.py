"""Quantization on the Hugging Face models users bring: GPT-2's Conv1D, tied weights, T5, bad names."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.quantization.ptq import dequantize_, quantizable_layers, quantize_
from lightning_lowmem.functional.quantization.layers import conv1d_to_linear, convert_conv1d_, is_conv1d, tied_groups
from lightning_lowmem.functional.quantization.qat import convert_qat_, prepare_qat_, set_fake_quant_enabled
from lightning_lowmem.warnings import LowMemWarning

pytest.importorskip("transformers")

from tests.hf_zoo import T5_TABLES, constant_bytes, hf_batch, hf_module, size_ratio, t5_tied_names  # noqa: E402

warnings.filterwarnings("ignore", module="torchao")

_BATCHES: dict[str, dict[str, torch.Tensor]] = {}


def batch_of(family: str) -> dict[str, torch.Tensor]:
    if family not in _BATCHES:
        _BATCHES[family] = hf_batch(family, seq_len=16, batch_size=2)
    return _BATCHES[family]


def logits(module: nn.Module, family: str) -> torch.Tensor:
    with torch.no_grad():
        return module(**batch_of(family)).logits


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return float((output - reference).norm() / reference.norm())


def saved_bytes(module: nn.Module) -> int:
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    return len(buffer.getvalue())


def quantizable_kinds(module: nn.Module) -> list[str]:
    return [n for n, m in module.named_modules() if isinstance(m, (nn.Linear, nn.Embedding)) or is_conv1d(m)]


# family -> (tied group, min whole-model size ratio at width 64)
EXPECTED = {
    "gpt2": (["model.transformer.wte", "model.lm_head"], 3.6),
    "llama": (None, 3.7),
    "bert": (["model.bert.embeddings.word_embeddings", "model.cls.predictions.decoder"], 3.45),
    "t5": (t5_tied_names(), 3.7),  # four names on transformers 5, two on 4.x (the stacks hold `shared` itself)
}


def test_int8_converts_every_layer_of_every_family_keeps_ties_and_shrinks(hf_family):
    module = hf_module(hf_family).eval()
    reference = logits(module, hf_family)
    every_layer = quantizable_kinds(module)
    float_saved = saved_bytes(module)
    report = quantize_(module, "int8_dynamic")
    tied, min_ratio = EXPECTED[hf_family]
    assert report.converted == every_layer  # nothing left out: Conv1D, embeddings, heads
    weights_before = report.bytes_before - constant_bytes(module)  # e.g. 4.x GPT-2's causal-mask buffers
    assert report.converted_bytes / weights_before > 0.95  # LayerNorms and biases stay float
    assert size_ratio(report.bytes_before, report.bytes_after, module) > min_ratio
    assert float_saved / saved_bytes(module) > 3.0  # the file too (pickle overhead per tensor at width 64)
    assert relative_error(logits(module, hf_family), reference) < 0.03  # random weights: ~0.65% per int8 layer
    if tied is None:
        assert report.tied == [] and module.model.lm_head.weight is not module.model.model.embed_tokens.weight
    else:
        assert report.tied == [tied]
        weights = {id(module.get_submodule(name).weight) for name in tied}
        assert len(weights) == 1  # still one tensor: stored once
        assert type(module.get_submodule(tied[0]).weight).__name__ == "IntxUnpackedToInt8Tensor"


def test_gpt2_conv1d_becomes_exact_linear():
    module = hf_module("gpt2").eval()
    conv = module.model.transformer.h[0].attn.c_attn
    linear = conv1d_to_linear(conv)
    assert (linear.in_features, linear.out_features) == (64, 192)
    assert linear.weight.untyped_storage().data_ptr() == conv.weight.untyped_storage().data_ptr()  # no copy
    assert linear.bias is conv.bias
    reference = logits(module, "gpt2")
    replaced = convert_conv1d_(module)
    assert len(replaced) == 8 and not any(is_conv1d(m) for m in module.modules())
    assert torch.equal(logits(module, "gpt2"), reference)  # bit-identical
    with pytest.raises(TypeError, match="`layer` must be a transformers Conv1D, got Linear"):
        conv1d_to_linear(nn.Linear(2, 2))


def test_gpt2_int8_quantizes_conv1d_not_only_the_ends():
    """Issue 16: only wte / wpe / lm_head were converted, 1.05x smaller, tie broken."""
    module = hf_module("gpt2", n_embd=128).eval()
    report = quantize_(module, "int8_weight_only")
    assert len(report.conv1d) == 8 and "model.transformer.h.1.mlp.c_fc" in report.conv1d
    assert type(module.model.transformer.h[1].mlp.c_fc).__name__ == "Linear"
    assert type(module.model.transformer.h[1].mlp.c_fc.weight).__name__ == "Int8Tensor"
    assert size_ratio(report.bytes_before, report.bytes_after, module) > 3.7
    assert module.model.lm_head.weight is module.model.transformer.wte.weight


def test_tied_weight_serves_lookup_and_head_from_one_int8_copy():
    module = hf_module("gpt2").eval()
    quantize_(module, "int8_dynamic")
    table = module.model.transformer.wte
    shared = table.weight
    ids = torch.tensor([[1, 5, 9]])
    assert torch.equal(table(ids), shared.dequantize()[ids])  # the lookup reads the int8 rows
    hidden = torch.randn(2, 64)
    assert torch.allclose(module.model.lm_head(hidden), hidden @ shared.dequantize().T, atol=1e-5)  # the head too
    state = module.state_dict()
    assert state["model.lm_head.weight"] is not None
    # one copy of the data in the file: the head's entry adds its description, not its 264 x 64 int8 values
    buffer = io.BytesIO()
    torch.save({k: v for k, v in state.items() if k != "model.lm_head.weight"}, buffer)
    assert saved_bytes(module) - len(buffer.getvalue()) < shared.qdata.numel() // 4


def test_dequantize_keeps_ties():
    module = hf_module("gpt2").eval()
    quantize_(module, "int8_weight_only")
    dequantize_(module)
    assert module.model.lm_head.weight is module.model.transformer.wte.weight
    assert type(module.model.lm_head.weight) is nn.Parameter


def test_tied_group_is_quantized_whole_or_not_at_all():
    module = hf_module("gpt2").eval()
    names = quantizable_layers(module, "int8_dynamic", skip_modules=["lm_head"])  # a dotted suffix
    assert "model.transformer.wte" not in names and "model.lm_head" not in names
    assert "model.transformer.wpe" in names
    linear_only = quantizable_layers(module, "int8_dynamic", embeddings=False)
    assert "model.lm_head" not in linear_only  # it is the token table too
    report = quantize_(module, "int8_dynamic", skip_modules=["lm_head"])
    assert module.model.lm_head.weight is module.model.transformer.wte.weight
    assert type(module.model.lm_head.weight) is nn.Parameter and report.tied == []


def test_skip_modules_naming_nothing_lists_real_layers():
    module = hf_module("gpt2")
    with pytest.raises(
        ValueError,
        match=r"`skip_modules` entry 'lm_haed' matches no submodule of HFLanguageModel.*"
        r"model.transformer.h.0.attn.c_attn.*layer classes: \[.*'Conv1D'",
    ):
        quantize_(module, "int8_dynamic", skip_modules=["lm_haed"])
    assert all(type(p) is nn.Parameter for p in module.parameters())  # nothing happened
    report = quantize_(module, "int8_dynamic", skip_modules=["*.mlp.*", "Embedding"])  # a glob and a class name
    assert not any(".mlp." in name for name in report.converted)
    assert not any(isinstance(module.get_submodule(name), nn.Embedding) for name in report.converted)


def test_warns_when_less_than_half_of_the_bytes_are_converted():
    module = hf_module("gpt2")
    with pytest.warns(
        LowMemWarning,
        match=r"converted 1 layers holding only \d+% of HFLanguageModel's parameter bytes.*"
        r"float parameters remain in: (Conv1D|Linear)",
    ):
        report = quantize_(module, "int8_dynamic", filter_fn=lambda layer, fqn: fqn.endswith("h.0.attn.c_proj"))
    assert report.converted == ["model.transformer.h.0.attn.c_proj"] and report.converted_share < 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error", LowMemWarning)
        quantize_(hf_module("gpt2"), "int8_dynamic")  # the whole model: no warning


def test_tied_groups_finds_shared_weights():
    module = hf_module("t5")
    assert tied_groups(module) == [EXPECTED["t5"][0]]
    assert tied_groups(hf_module("llama")) == []


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_qat_fake_quantizes_conv1d_and_tied_head_then_converts_them(family):
    from torchao.quantization.qat import FakeQuantizedLinear

    module = hf_module(family).eval()
    prepared = prepare_qat_(module, "int8_weight_only")
    tied = EXPECTED[family][0]
    head = "model.lm_head"
    assert head in prepared and isinstance(module.get_submodule(head), FakeQuantizedLinear)
    assert module.get_submodule(head).weight is module.get_submodule(tied[0]).weight  # tied while training
    if family == "gpt2":
        assert isinstance(module.model.transformer.h[0].attn.c_attn, FakeQuantizedLinear)
        assert len(prepared) == 9  # 8 Conv1D + the head
    set_fake_quant_enabled(module, True)
    fake_quantized = logits(module, family)
    report = convert_qat_(module, "int8_weight_only")
    assert report.tied == [tied] and set(tied) <= set(report.converted)
    names = T5_TABLES if family == "t5" else tied
    assert len({id(module.get_submodule(name).weight) for name in names}) == 1  # stored once
    assert not any(isinstance(m, FakeQuantizedLinear) for m in module.modules())
    converted = logits(module, family)
    # the head and linear layers compute what they trained to; the lookup now reads the int8 table too
    assert relative_error(converted, fake_quantized) < 0.02
