"""`check_ptq_arguments` / `check_submodule`: each rejected combination, with the argument named."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_lowmem.functional.quantization.arguments import check_ptq_arguments, check_submodule


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "int3"}, ValueError, r"`mode`='int3' is not a known quantization mode"),
        ({"mode": "int8_static"}, ValueError, r"'int8_static' needs `module_name`"),
        ({"module_name": "model"}, ValueError, r"`module_name`='model' / `compile`=False apply to mode='int8_static'"),
        ({"compile": True}, ValueError, r"`compile`=True apply to mode='int8_static' only, got mode='int8_dynamic'"),
        ({"calibration_batches": 0}, ValueError, r"`calibration_batches` must be an int > 0, got 0"),
        ({"tolerance": 0.1}, ValueError, r"`tolerance`=0.1 needs `monitor`"),
        ({"monitor": "val_acc", "tolerance": -1}, ValueError, r"`tolerance` must be a number >= 0, got -1"),
        ({"monitor_mode": "up"}, ValueError, r"`monitor_mode`='up' must be 'max' or 'min'"),
        ({"skip_modules": "lm_head"}, TypeError, r"got the string 'lm_head'"),
        ({"mode": "int8_static", "module_name": "model", "embeddings": True}, ValueError, r"embeddings"),
    ],
)
def test_check_ptq_arguments_rejects(kwargs, error, match):
    kwargs = {"mode": "int8_dynamic", **kwargs}
    with pytest.raises(error, match=match):
        check_ptq_arguments(**kwargs)


def test_check_ptq_arguments_accepts_valid_combinations():
    from lightning_lowmem.functional.config import QuantizationConfig

    static = check_ptq_arguments("int8_static", module_name="model", compile=True, calibration_batches=2)
    assert static == QuantizationConfig("int8_static")
    weight_only = check_ptq_arguments("int8_weight_only", monitor="val_loss", tolerance=0, monitor_mode="min")
    assert weight_only == QuantizationConfig("int8_weight_only")


def test_check_submodule_returns_the_child_or_lists_children():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    assert check_submodule(model, "0").out_features == 3
    with pytest.raises(
        ValueError, match=r"`module_name`='body' is not a submodule of Sequential; its children are \['0', '1'\]"
    ):
        check_submodule(model, "body")
