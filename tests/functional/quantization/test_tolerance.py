"""`quantize_within_tolerance`: PTQ's tolerance workflow on a plain torch model and a plain evaluate callable (#27)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.config import QuantizationConfig
from lightning_lowmem.functional.quantization.tolerance import quantize_within_tolerance
from lightning_lowmem.warnings import NoEffectWarning


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _quantized(module: nn.Module, name: str) -> bool:
    return type(module.get_submodule(name).weight.data) is not torch.Tensor


class LayerPenalty:
    """A metric that knows which layers are quantized: 1.0 float, minus a fixed penalty per quantized layer.
    Records every model state it was called on."""

    def __init__(self, penalties: dict[str, float]) -> None:
        self.penalties, self.calls = penalties, []

    def __call__(self, module: nn.Module) -> float:
        quantized = sorted(name for name in self.penalties if _quantized(module, name))
        self.calls.append(quantized)
        return 1.0 - sum(self.penalties[name] for name in quantized)


def test_everything_quantized_when_the_metric_allows():
    model = _model()
    metric = LayerPenalty({"0": 0.01, "2": 0.01, "4": 0.01})
    outcome = quantize_within_tolerance(model, QuantizationConfig("int8_weight_only"), metric, tolerance=0.05)
    assert outcome.met and outcome.quantized == ["0", "2", "4"] and outcome.kept_float == []
    assert outcome.baseline == 1.0 and outcome.metric == pytest.approx(0.97)
    assert metric.calls == [[], ["0", "2", "4"]]  # float, then all: no per-layer search needed
    assert all(_quantized(model, name) for name in ("0", "2", "4"))
    assert outcome.report.converted == ["0", "2", "4"] and outcome.report.mode == "int8_weight_only"


def test_the_most_sensitive_layer_is_kept_float():
    model = _model()
    weight = model[2].weight
    metric = LayerPenalty({"0": 0.01, "2": 0.2, "4": 0.02})
    outcome = quantize_within_tolerance(model, "int8_weight_only", metric, tolerance=0.05)
    assert outcome.met and outcome.quantized == ["0", "4"] and outcome.kept_float == ["2"]
    assert outcome.metric == pytest.approx(0.97)
    assert outcome.sensitivity == pytest.approx({"0": 0.01, "2": 0.2, "4": 0.02})
    assert outcome.tried == [(0, pytest.approx(0.77)), (1, pytest.approx(0.97))]
    assert not _quantized(model, "2") and model[2].weight is weight  # the float Parameter itself, untouched
    assert _quantized(model, "0") and _quantized(model, "4")


def test_lower_is_better_and_not_met_leaves_the_model_float():
    model = _model()
    loss = lambda module: 0.5 + 0.1 * sum(_quantized(module, name) for name in ("0", "2", "4"))  # noqa: E731
    outcome = quantize_within_tolerance(model, "int8_weight_only", loss, tolerance=0.05, higher_is_better=False)
    assert not outcome.met and outcome.quantized == [] and outcome.kept_float == ["0", "2", "4"]
    assert outcome.metric == outcome.baseline == 0.5 and outcome.report is None
    assert not any(_quantized(model, name) for name in ("0", "2", "4"))


def test_a_real_metric_on_a_real_model():
    """Output error against the float model: int8 weight-only stays within 0.05 (measured ~0.003)."""
    model = _model()
    inputs = torch.randn(256, 64)
    reference = model(inputs).detach()

    def error(module: nn.Module) -> float:
        with torch.no_grad():
            return float((module(inputs) - reference).abs().max())

    outcome = quantize_within_tolerance(model, "int8_weight_only", error, tolerance=0.05, higher_is_better=False)
    assert outcome.met and outcome.baseline == 0.0 and 0.0 < outcome.metric < 0.05
    assert error(model) == pytest.approx(outcome.metric)  # the model left quantized is the one measured


def test_arguments():
    model = _model()
    with pytest.raises(ValueError, match=r"`tolerance` must be >= 0, got -0.1"):
        quantize_within_tolerance(model, "int8_weight_only", lambda m: 1.0, tolerance=-0.1)
    with pytest.raises(ValueError, match=r"`mode`='int8_static' is calibrated on batches"):
        quantize_within_tolerance(model, "int8_static", lambda m: 1.0, tolerance=0.1)
    with pytest.raises(ValueError, match=r"`mode`='int9' is not a known quantization mode"):
        quantize_within_tolerance(model, "int9", lambda m: 1.0, tolerance=0.1)
    with pytest.warns(NoEffectWarning, match="found no quantizable layer"):
        outcome = quantize_within_tolerance(nn.Sequential(nn.ReLU()), "int8_weight_only", lambda m: 1.0, 0.1)
    assert not outcome.met and outcome.quantized == []
