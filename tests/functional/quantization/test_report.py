"""What `PostTrainingQuantization` logs and warns, built in `functional/quantization/report.py`."""

from __future__ import annotations

import pytest

from lightning_lowmem.functional.quantization.report import (
    QuantizationReport,
    logged_metrics,
    tolerance_failure_message,
)


def test_logged_metrics_keys_and_values():
    report = QuantizationReport("int8_weight_only", bytes_before=1000, bytes_after=400, converted_bytes=800)
    metrics = logged_metrics({"bytes": 1000}, {"bytes": 250}, ["lm_head", "fc"], report)
    assert metrics == {
        "lowmem/quantization/size_ratio": 4.0,
        "lowmem/quantization/kept_float": 2.0,
        "lowmem/quantization/converted_share": pytest.approx(0.8),
    }
    assert logged_metrics({"bytes": 10}, {"bytes": 0}, [], report)["lowmem/quantization/size_ratio"] == 10.0


def test_tolerance_failure_message_lists_every_layer_drop():
    message = tolerance_failure_message("val_loss", 0.5, 1.23456, {"a.fc": 0.123456, "b": 2.0})
    assert "'val_loss' within tolerance 0.5 of 1.235" in message
    assert "(per-layer drops: a.fc: 0.1235, b: 2)" in message
