"""The pieces the quantization callbacks delegate to: the state-dict matcher, the search units, the tables."""

import math

import pytest
import torch
from torch import nn

from lightning_lowmem.callbacks.quantization_aware_training import QuantizationAwareTraining
from lightning_lowmem.functional.quantization.layers import convert_conv1d_, is_conv1d
from lightning_lowmem.functional.quantization.calibration import calibration_calls, static_candidates
from lightning_lowmem.functional.quantization.matching import float_weights_for_load_, requantize_
from lightning_lowmem.functional.quantization.ptq import quantize_, temporarily_quantized
from lightning_lowmem.functional.quantization.qat import convert_qat_, prepare_qat_, qat_base_config
from lightning_lowmem.functional.quantization.report import comparison_table
from lightning_lowmem.functional.quantization.search import expand_units, size_and_latency, tied_units
from lightning_lowmem.functional.quantization.serialization import is_quantized_tensor
from tests.hf_zoo import hf_batch, hf_module


def _gpt2(seed: int = 0) -> nn.Module:
    return hf_module("gpt2", seed=seed, n_layer=1).eval()  # no dropout: outputs comparable


def test_matcher_maps_a_conv1d_converted_quantized_state_dict_onto_a_float_gpt2():
    source = _gpt2()
    report = quantize_(source, "int8_weight_only")
    assert report.conv1d  # GPT-2's Conv1D layers became nn.Linear before quantization
    state = source.state_dict()
    target = _gpt2(seed=1)
    matcher = QuantizationAwareTraining("int8_weight_only")
    matcher.match_state_dict(target, state, "")
    assert matcher.converted == sorted(report.converted)
    assert matcher.conv1d == sorted(report.conv1d)  # found without a record: a quantized weight at a Conv1D
    target.load_state_dict(state)
    batch = hf_batch("gpt2")
    with torch.no_grad():
        assert torch.equal(target(**batch).logits, source(**batch).logits)
    head, table = target.model.lm_head.weight, target.model.transformer.wte.weight
    assert head is table and is_quantized_tensor(head)  # the tie holds, one quantized copy


def test_float_state_dict_into_a_converted_model_loads_float_then_is_quantized_again_once():
    model, donor = _gpt2(), _gpt2(seed=1)
    convert_conv1d_(donor, [name for name, layer in donor.named_modules() if is_conv1d(layer)])
    float_state = {k: v.clone() for k, v in donor.state_dict().items()}  # e.g. a fake-quantized training checkpoint
    prepare_qat_(model, "int8_weight_only")
    convert_qat_(model, "int8_weight_only")  # QAT converted the model at fit end
    names = float_weights_for_load_(model, float_state)
    assert "model.lm_head" in names and "model.transformer.wte" in names
    assert "model.transformer.h.0.mlp.c_fc" in names  # the converted Conv1D (an nn.Linear now)
    assert not any(is_quantized_tensor(model.get_submodule(name).weight) for name in names)
    model.load_state_dict(float_state)
    requantize_(model, names, qat_base_config("int8_weight_only", 32))
    assert all(is_quantized_tensor(model.get_submodule(name).weight) for name in names)
    assert model.model.lm_head.weight is model.model.transformer.wte.weight  # quantized once, shared again
    expected = donor.model.transformer.h[0].mlp.c_fc.weight
    error = (model.model.transformer.h[0].mlp.c_fc.weight.dequantize() - expected).abs().max()
    assert error <= expected.abs().max() / 127  # the donor's float values, int8-rounded


def test_tied_units_make_a_tied_group_one_search_candidate():
    model = _gpt2()
    candidates = ["model.transformer.wte", "model.transformer.h.0.attn.c_attn", "model.lm_head"]
    units = tied_units(model, candidates)
    assert units == {
        "model.transformer.wte": ["model.transformer.wte", "model.lm_head"],
        "model.transformer.h.0.attn.c_attn": ["model.transformer.h.0.attn.c_attn"],
    }
    assert expand_units(units, ["model.transformer.wte"]) == ["model.transformer.wte", "model.lm_head"]


def test_temporarily_quantized_gives_back_the_same_conv1d_layer_and_parameter():
    model = _gpt2()
    name = "model.transformer.h.0.mlp.c_fc"
    layer, weight = model.get_submodule(name), model.get_submodule(name).weight
    with temporarily_quantized(model, "int8_weight_only", [name]):
        assert isinstance(model.get_submodule(name), nn.Linear) and is_quantized_tensor(
            model.get_submodule(name).weight
        )
    assert model.get_submodule(name) is layer and layer.weight is weight


def test_size_and_latency_counts_the_quantized_bytes():
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    before = size_and_latency(model)
    assert before["bytes"] == 64 * 64 * 4 and math.isnan(before["latency_s"])
    timed = size_and_latency(model, (torch.randn(2, 64),), repeats=2, warmup=0)
    assert timed["latency_s"] > 0 and model.training  # mode restored
    quantize_(model, "int8_weight_only")
    assert size_and_latency(model)["bytes"] < 64 * 64 * 2  # int8 values + per-row scales


def test_comparison_table_says_when_quantized_is_slower():
    table = comparison_table(
        "int8_dynamic",
        {"bytes": 4096, "latency_s": 0.001, "metric": 0.9},
        {"bytes": 1024, "latency_s": 0.003, "metric": 0.89},
        ["lm_head"],
    )
    rows = table.splitlines()
    assert rows[2].split() == ["float", "4.00", "KiB", "1.000", "ms", "0.9000"]
    assert rows[3].split() == ["quantized", "1.00", "KiB", "3.000", "ms", "0.8900"]
    assert rows[4] == "layers kept in float: ['lm_head']" and "3.0x SLOWER" in rows[5]


def test_calibration_records_the_child_calls_of_the_first_batches():
    model = nn.Sequential()
    model.add_module("model", nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    batches = [(torch.randn(3, 4),) for _ in range(5)]
    calls = calibration_calls(model, "model", batches, 2)
    assert len(calls) == 2 and torch.equal(calls[1].args[0], batches[1][0])
    assert static_candidates(model, "model", ["model.2"], None) == ["model.0"]
    with pytest.raises(ValueError, match=r"`module_name`='model.0' was never called"):
        calibration_calls(model, "model.0", [], 2)
