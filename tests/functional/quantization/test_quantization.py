"""quantize_ modes, static pt2e, QAT prepare/convert, serialization and the float-fallback search."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.quantization.ptq import (
    available_modes,
    dequantize_,
    drop_zero_point,
    drop_zero_points_,
    quantize_,
    quantized_copy,
    search_float_fallback,
    torchao_config,
)
from lightning_lowmem.functional.quantization.qat import convert_qat_, prepare_qat_
from lightning_lowmem.functional.quantization.static import quantize_static
from lightning_lowmem.memory.measure import state_bytes
from lightning_lowmem.warnings import NoEffectWarning

warnings.filterwarnings("ignore", module="torchao")


def wide_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return float((output - reference).detach().norm() / reference.detach().norm())


# mode, weight class name, max relative error, min size ratio
IN_PLACE_CASES = [
    ("int8_dynamic", "Int8Tensor", 0.03, 3.8),
    ("int8_weight_only", "Int8Tensor", 0.03, 3.8),
    ("intx4_weight_only", "IntxUnpackedToInt8Tensor", 0.15, 3.3),  # int4 values, int8 storage + group scales
]


@pytest.mark.parametrize(("mode", "weight_type", "max_error", "min_ratio"), IN_PLACE_CASES)
def test_mode_converts_linears_stays_close_and_shrinks(mode, weight_type, max_error, min_ratio):
    model = wide_mlp()
    inputs = torch.randn(16, 256)
    reference = model(inputs)
    report = quantize_(model, mode)
    assert report.converted == ["0", "2"]
    assert [type(model[i].weight).__name__ for i in (0, 2)] == [weight_type, weight_type]
    assert relative_error(model(inputs), reference) < max_error
    assert report.size_ratio > min_ratio
    assert report.module is model


def test_static_int8_converts_all_linears_and_shrinks():
    model = wide_mlp()
    batches = [torch.randn(16, 256) for _ in range(4)]
    reference = model(batches[0])
    report = quantize_(model, "int8_static", calibration_data=batches)
    assert report.converted == ["0", "2"]
    int8_weights = [t for t in report.module.state_dict().values() if t.dtype == torch.int8]
    assert len(int8_weights) == 2
    assert relative_error(report.module(batches[0]), reference) < 0.05
    assert report.size_ratio > 3.5
    assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.dtype == torch.float32  # input untouched


def test_static_skip_modules_keeps_layer_float():
    model = wide_mlp()
    batches = [torch.randn(8, 256) for _ in range(2)]
    report = quantize_static(model, (batches[0],), batches, skip_modules=["2"])
    assert report.converted == ["0"]
    assert sum(t.dtype == torch.int8 for t in report.module.state_dict().values()) == 1


def test_filter_fn_and_skip_modules_choose_layers():
    model = wide_mlp()
    assert quantize_(model, "int8_weight_only", skip_modules=["0"]).converted == ["2"]
    model = wide_mlp()
    assert quantize_(model, "int8_weight_only", filter_fn=lambda layer, fqn: layer.out_features == 256).converted == [
        "0"
    ]
    assert type(model[2].weight) is nn.Parameter


def test_int4_weight_only_says_cpu_is_unsupported():
    assert "int4_weight_only" not in available_modes("cpu")
    assert {"int8_dynamic", "int8_weight_only", "intx4_weight_only", "int8_static"} <= set(available_modes("cpu"))
    with pytest.raises(ValueError, match="no CPU kernel.*intx4_weight_only"):
        quantize_(wide_mlp(), "int4_weight_only")


def test_bad_input_errors():
    with pytest.raises(ValueError, match="`mode`='int3' is not a known quantization mode"):
        quantize_(wide_mlp(), "int3")
    with pytest.raises(ValueError, match="needs `calibration_data`"):
        quantize_(wide_mlp(), "int8_static")
    with pytest.raises(ValueError, match="`group_size` must be a positive int"):
        quantize_(wide_mlp(), "intx4_weight_only", group_size=0)
    with pytest.raises(TypeError, match="`skip_modules` must be a list"):
        quantize_(wide_mlp(), "int8_dynamic", skip_modules="0")


def test_no_quantizable_layer_warns_and_changes_nothing(tiny_convnet):
    tiny_convnet.head = nn.Identity()  # only Conv2d left: the int4 modes do not quantize convolutions
    with pytest.warns(NoEffectWarning, match="no quantizable nn.Linear"):
        report = quantize_(tiny_convnet, "intx4_weight_only")
    assert report.converted == [] and report.bytes_after == report.bytes_before


@pytest.mark.parametrize("mode", ["int8_dynamic", "int8_weight_only"])
def test_int8_weights_drop_torchaos_zero_points_with_identical_outputs(mode):
    from torchao.quantization import quantize_ as torchao_quantize_

    model = wide_mlp()
    reference = copy.deepcopy(model)
    torchao_quantize_(reference, torchao_config(mode))
    assert not reference[0].weight.zero_point.any()  # torchao keeps an all-zero int8 zero point per row
    report = quantize_(model, mode)
    inputs = torch.randn(16, 256)
    assert model[0].weight.zero_point is None and model[2].weight.zero_point is None
    assert torch.equal(model(inputs), reference(inputs))
    rows, int8_values = 256 + 64, 256 * 256 + 64 * 256
    assert report.bytes_after == int8_values + 4 * rows + 4 * rows  # int8 values, fp32 scale per row, fp32 biases
    assert state_bytes(reference)["parameters"] - report.bytes_after == rows  # one byte per row freed


def test_drop_zero_points_leaves_nonzero_and_required_zero_points():
    model = wide_mlp()
    quantize_(model, "intx4_weight_only")  # IntxUnpackedToInt8Tensor: zero point is not optional
    assert drop_zero_points_(model) == 0 and model[0].weight.zero_point is not None
    model = wide_mlp()
    quantize_(model, "int8_weight_only")
    assert drop_zero_points_(model) == 0  # already dropped
    weight = model[0].weight
    weight.zero_point = torch.ones_like(weight.scale, dtype=torch.int8)  # an asymmetric one is kept
    assert drop_zero_point(weight) == 0 and weight.zero_point is not None
    assert drop_zero_point(torch.zeros(3)) == 0


@pytest.mark.parametrize("mode", ["int8_dynamic", "int8_weight_only", "intx4_weight_only"])
def test_save_load_gives_identical_outputs(mode):
    model = wide_mlp()
    quantize_(model, mode)
    inputs = torch.randn(4, 256)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    restored = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))
    quantize_(restored, mode)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(restored(inputs), model(inputs))


def test_dequantize_restores_float_weights():
    model = wide_mlp()
    quantize_(model, "int8_weight_only")
    assert dequantize_(model) == ["0", "2"]
    assert type(model[0].weight) is nn.Parameter and model[0].weight.requires_grad


def test_qat_prepare_then_convert_matches_fake_quantized_outputs():
    from torchao.quantization.qat import FakeQuantizedLinear

    model = wide_mlp()
    weight = model[0].weight
    assert prepare_qat_(model, "intx4_weight_only") == ["0", "2"]
    assert isinstance(model[0], FakeQuantizedLinear) and model[0].weight is weight  # same Parameter
    inputs = torch.randn(4, 256)
    fake_quantized = model(inputs)
    fake_quantized.sum().backward()
    assert weight.grad is not None
    report = convert_qat_(model, "intx4_weight_only")
    assert report.converted == ["0", "2"] and type(model[0]) is nn.Linear
    assert type(model[0].weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert torch.allclose(model(inputs), fake_quantized, atol=1e-5)


def test_search_keeps_most_sensitive_layer_float():
    drops = {"a": 0.05, "b": 0.001, "c": 0.002}  # metric = 1 - sum of drops of the quantized layers
    result = search_float_fallback(list(drops), lambda names: 1.0 - sum(drops[n] for n in names), tolerance=0.01)
    assert result.met and result.kept_float == ["a"] and sorted(result.quantized) == ["b", "c"]
    assert result.sensitivity["a"] == pytest.approx(0.05)
    assert result.baseline - result.metric <= 0.01


def test_search_with_zero_tolerance_refuses_and_quantizes_nothing():
    drops = {"a": 0.05, "b": 0.001}
    result = search_float_fallback(list(drops), lambda names: 1.0 - sum(drops[n] for n in names), tolerance=0.0)
    assert not result.met and result.quantized == [] and result.kept_float == ["a", "b"]
    with pytest.raises(ValueError, match="`tolerance` must be >= 0"):
        search_float_fallback(["a"], lambda names: 1.0, tolerance=-1)


def test_quantized_copy_leaves_original_float():
    model = wide_mlp()
    clone = quantized_copy(model, "int8_weight_only", ["2"])
    assert type(clone[2].weight).__name__ == "Int8Tensor" and type(model[2].weight) is nn.Parameter


def test_compile_inference_bad_input():
    from lightning_lowmem.functional.quantization.compile import compile_inference

    with pytest.raises(TypeError, match="`module` must be an nn.Module, got function"):
        compile_inference(lambda x: x)
    with pytest.raises(
        TypeError, match="`example_inputs` must be a tuple.*or a dict batch, got Tensor.*`\\(tensor,\\)`"
    ):
        compile_inference(wide_mlp(), torch.randn(2, 256))


class _KeywordModel(nn.Module):
    """Takes a Hugging Face-style dict batch as keywords: ``model(input_ids=..., attention_mask=...)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = nn.Embedding(32, 64), nn.Linear(64, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).float()  # (B, T, 1)
        return self.out((self.embed(input_ids) * mask).sum(1) / mask.sum(1))  # (B, 4)


@pytest.mark.slow
def test_compile_inference_takes_a_dict_batch():
    from lightning_lowmem.functional.quantization.compile import compile_inference

    model = _KeywordModel().eval()
    quantize_(model, "int8_weight_only")
    batch = {"input_ids": torch.randint(0, 32, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    batch["attention_mask"][1, 5:] = 0
    with torch.no_grad():
        reference = model(**batch)
    fast = compile_inference(model, (batch,))  # was: TypeError, the dict given as `input_ids`
    torch.testing.assert_close(fast(batch), reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fast(**batch), reference, atol=1e-4, rtol=1e-4)
    assert isinstance(compile_inference(_KeywordModel(), batch), nn.Module)  # a bare dict is a batch too


@pytest.mark.slow
def test_compiled_int8_static_stays_close_to_float_for_any_batch():
    from lightning_lowmem.functional.quantization.compile import CompiledInference, compile_inference

    model = wide_mlp().eval()
    batches = [torch.randn(16, 256) for _ in range(4)]
    quantized = quantize_(model, "int8_static", calibration_data=batches).module
    fast = compile_inference(quantized, (batches[0],))  # the docstring example, compiled for real
    assert isinstance(fast, CompiledInference) and set(fast.state_dict()) == {
        f"module.{k}" for k in quantized.state_dict()
    }
    for inputs in (batches[1], torch.randn(3, 256)):  # a new batch size recompiles, still with frozen weights
        with torch.no_grad():
            reference = model(inputs)
        assert relative_error(fast(inputs), reference) < 0.05
        assert relative_error(fast(inputs), quantized(inputs)) < 0.02  # the fused kernels match the reference graph


# --- embeddings ----------------------------------------------------------------------------------------


def embedding_model() -> nn.Sequential:
    """Token table 256 x 256 -> Linear 256 -> 256: an embedding-heavy model, like a small LM's ends."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(256, 256), nn.Linear(256, 256))


@pytest.mark.parametrize(
    ("mode", "max_error", "min_ratio"),
    [
        ("int8_dynamic", 0.03, 3.8),
        ("int8_weight_only", 0.03, 3.8),
        ("intx4_weight_only", 0.15, 3.3),
    ],
)
def test_embeddings_are_quantized_by_default_stay_close_and_shrink(mode, max_error, min_ratio):
    model = embedding_model()
    tokens = torch.randint(0, 256, (4, 16))
    reference = model(tokens)
    linear_only = quantize_(embedding_model(), mode, embeddings=False)
    report = quantize_(model, mode)
    assert report.converted == ["0", "1"] and linear_only.converted == ["1"]
    assert type(model[0].weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert model[0].weight.qdata.dtype == torch.int8
    assert relative_error(model(tokens), reference) < max_error
    assert report.size_ratio > min_ratio > linear_only.size_ratio  # the float table capped it


def test_embeddings_false_keeps_table_float_and_static_refuses_true():
    model = embedding_model()
    assert quantize_(model, "int8_weight_only", embeddings=False).converted == ["1"]
    assert type(model[0].weight) is nn.Parameter
    assert quantize_(embedding_model(), "int8_weight_only", skip_modules=["1"]).converted == ["0"]
    with pytest.raises(ValueError, match="`embeddings`=True is not supported with mode='int8_static'"):
        quantize_(
            embedding_model(), "int8_static", embeddings=True, calibration_data=[torch.zeros(1, 4, dtype=torch.long)]
        )
    with pytest.raises(TypeError, match="`embeddings` must be True, False or None.*got 'yes'"):
        quantize_(embedding_model(), "int8_dynamic", embeddings="yes")


def test_embedding_with_max_norm_stays_float():
    model = nn.Sequential(nn.Embedding(256, 64, max_norm=1.0), nn.Linear(64, 256))
    assert quantize_(model, "int8_weight_only").converted == ["1"]  # max_norm renormalizes the table in place


def test_tiny_gpt_int8_quantizes_token_and_position_tables(tiny_gpt):
    tokens = torch.randint(0, 256, (2, 16))
    reference = tiny_gpt(tokens)
    linear_only = quantize_(copy.deepcopy(tiny_gpt), "int8_dynamic", embeddings=False)
    report = quantize_(tiny_gpt, "int8_dynamic")
    assert sorted(set(report.converted) - set(linear_only.converted)) == ["wpe", "wte"]
    assert relative_error(tiny_gpt(tokens), reference) < 0.05
    # n_embd 32: a row is 32 int8 + 4 (fp32 scale) + 1 (zero point) bytes, LayerNorms and biases stay float
    assert report.size_ratio > 3.3 > 2.9 > linear_only.size_ratio


@pytest.mark.parametrize("mode", ["int8_dynamic", "intx4_weight_only"])
def test_embedding_save_load_and_dequantize(mode):
    model = embedding_model()
    quantize_(model, mode)
    tokens = torch.randint(0, 256, (4, 16))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    restored = nn.Sequential(nn.Embedding(256, 256), nn.Linear(256, 256))
    quantize_(restored, mode)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(restored(tokens), model(tokens))
    assert dequantize_(model) == ["0", "1"] and type(model[0].weight) is nn.Parameter
    assert torch.equal(model[0](tokens), restored[0](tokens))  # the lookup dequantizes the same int8 rows


# --- int8_static on CPUs without VNNI ---------------------------------------------------------------------


def quant_max_of(graph_module) -> set[int]:
    """The quant_max of every activation quantize node of a converted pt2e graph."""
    target = torch.ops.quantized_decomposed.quantize_per_tensor.default
    return {int(node.args[4]) for node in graph_module.graph.nodes if node.target == target}


@pytest.mark.parametrize(("vnni", "quant_max", "noted"), [(False, 127, True), (True, 255, False)])
def test_static_reduces_activation_range_only_without_vnni(monkeypatch, vnni, quant_max, noted):
    """Issue 20: compiled int8_static lost accuracy (0.145 relative error) on AVX2 CPUs without VNNI."""
    import lightning_lowmem.functional.quantization.static as static

    monkeypatch.setattr(static, "cpu_has_vnni", lambda: vnni)
    batches = [torch.randn(8, 256) for _ in range(2)]
    report = quantize_(wide_mlp(), "int8_static", calibration_data=batches)
    assert quant_max_of(report.module) == {quant_max}
    assert any("reduce_range" in note for note in report.notes) is noted


def test_cpu_has_vnni_reads_cpu_capabilities(monkeypatch):
    from lightning_lowmem.functional.quantization.static import cpu_has_vnni

    for capabilities, expected in [
        ({"architecture": "x86_64", "avx2": True}, False),  # AVX2 only (this project's CI machine)
        ({"architecture": "x86_64", "avx512_f": True}, False),  # Skylake-SP: AVX-512, no VNNI
        ({"architecture": "x86_64", "avx512_vnni": True}, True),
        ({"architecture": "x86_64", "amx_int8": True}, True),
        ({"architecture": "aarch64"}, True),  # nothing to avoid off x86
    ]:
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda caps=capabilities: caps)
        assert cpu_has_vnni() is expected, capabilities


# --- checkpoints: portable torchao tensors -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["int8_dynamic", "int8_weight_only", "intx4_weight_only"])
def test_portable_tensors_load_with_a_callable_map_location_and_weights_only(mode):
    """Lightning loads with map_location=lambda storage, loc: storage, which torchao's own pickling refuses."""
    from lightning_lowmem.functional.quantization.serialization import make_portable

    def round_trip(state):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        return torch.load(buffer, map_location=lambda storage, loc: storage, weights_only=True)

    model = embedding_model()
    quantize_(model, mode)
    tokens = torch.randint(0, 256, (2, 8))
    raw = {key: value.detach() for key, value in model.state_dict().items()}  # new objects: torchao's own pickling
    with pytest.raises(Exception, match="map_location"):
        round_trip(raw)  # what a plain Trainer ran into
    assert [make_portable(value) for value in raw.values()] == [True, True, False]
    # quantize_ also made the model's own state dicts portable (keep_portable_: weights-only Lightning saves)
    for loaded in (round_trip(raw), round_trip(model.state_dict())):
        restored = embedding_model()
        quantize_(restored, mode)
        restored.load_state_dict(loaded)
        assert torch.equal(restored(tokens), model(tokens))


def test_rebuild_refuses_classes_outside_torchao():
    from lightning_lowmem.functional.quantization.serialization import rebuild_quantized_tensor

    with pytest.raises(ValueError, match="refusing to rebuild 'os:system': only torchao"):
        rebuild_quantized_tensor("os:system", {}, None, [], [])
