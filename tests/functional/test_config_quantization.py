"""`QuantizationConfig` and `QATConfig`: the quantization mode and the group size validated in one place (#27)."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_lowmem.callbacks import PostTrainingQuantization, QuantizationAwareTraining
from lightning_lowmem.functional import QATConfig, QuantizationConfig, prepare_qat_, quantize_
from lightning_lowmem.functional.config import GROUP_SIZE, QAT_MODES, QUANTIZATION_MODES
from lightning_lowmem.functional.quantization import qat_layers, quantizable_layers

MODE = r"`mode`='int3' is not a known quantization mode; choose one of \['int8_dynamic'"
GROUP = r"`group_size` must be a positive int \(e.g. 32, 64, 128\), got 0"


@pytest.mark.parametrize(
    "build",
    [
        lambda **kw: QuantizationConfig(**kw),
        lambda **kw: quantize_(nn.Linear(64, 64), **kw),
        lambda **kw: quantizable_layers(nn.Linear(64, 64), **kw),
        lambda **kw: PostTrainingQuantization(**kw),
    ],
    ids=["config", "quantize_", "quantizable_layers", "PostTrainingQuantization"],
)
def test_every_entry_point_gives_the_configs_errors(build):
    with pytest.raises(ValueError, match=MODE):
        build(mode="int3")
    with pytest.raises(ValueError, match=GROUP):  # PostTrainingQuantization did not check it when built
        build(mode="intx4_weight_only", group_size=0)


QAT_MODE = r"`mode`='int8_dynamic' is not a QAT mode; choose one of \['int8_weight_only', 'int4_weight_only', 'intx4_weight_only'\]"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(mode="int8_dynamic"), ValueError, QAT_MODE),
        (dict(group_size=0), ValueError, GROUP),
        (dict(start_step=-1), ValueError, r"`start_step` must be an int >= 0, got -1"),
        (dict(freeze_bn_step=-2), ValueError, r"`freeze_bn_step` must be None or an int >= 0, got -2"),
        (dict(skip_modules="lm_head"), TypeError, r"`skip_modules` must be a list of module names, got the string"),
        (dict(convert_on_fit_end="yes"), TypeError, r"`convert_on_fit_end` must be True or False, got 'yes'"),
        (dict(filter_fn=3), TypeError, r"`filter_fn` must be None or a callable\(layer, fqn\) -> bool, got 3"),
    ],
)
def test_qat_config_errors_and_the_callback_raises_the_same(kwargs, error, match):
    with pytest.raises(error, match=match):
        QATConfig(**kwargs)
    with pytest.raises(error, match=match):
        QuantizationAwareTraining(**kwargs)


def test_the_duplicate_checks_are_gone():
    import lightning_lowmem.callbacks.quantization_aware_training as qat_callback
    from lightning_lowmem.functional.quantization import modes, ptq, qat

    assert not any(hasattr(module, "_check_mode") for module in (modes, ptq, qat))
    assert "QAT_MODES" not in vars(qat_callback)  # the callback has no mode list of its own
    assert modes.MODES is QUANTIZATION_MODES and qat.QAT_MODES is QAT_MODES


def test_configs_are_accepted_where_the_shorthand_is():
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 4))
    assert quantizable_layers(model, QuantizationConfig("intx4_weight_only", group_size=64)) == ["0"]  # 64 | 64, not 48
    assert quantizable_layers(model, "intx4_weight_only", group_size=16) == ["0", "2"]
    with pytest.raises(ValueError, match=r"`group_size`=64 is given beside a QuantizationConfig; set it in the config"):
        quantize_(model, QuantizationConfig("intx4_weight_only"), group_size=64)
    with pytest.raises(TypeError, match=r"quantize_ takes a mode name of \[.*\], got the torchao config"):
        from torchao.quantization import Int8WeightOnlyConfig

        quantize_(model, QuantizationConfig(Int8WeightOnlyConfig()))
    config = QATConfig("intx4_weight_only", skip_modules=["2"])
    assert config.skip_modules == ("2",) and config.quantization == QuantizationConfig("intx4_weight_only", GROUP_SIZE)
    assert qat_layers(model, config) == ["0"]
    with pytest.raises(ValueError, match=r"`group_size` given beside a QATConfig; set them in the config"):
        prepare_qat_(model, config, group_size=64)
    assert prepare_qat_(model, config) == ["0"]


def test_callbacks_keep_their_config():
    assert PostTrainingQuantization("intx4_weight_only", group_size=64).config == QuantizationConfig(
        "intx4_weight_only", 64
    )
    callback = QuantizationAwareTraining("int8_weight_only", start_step=5, skip_modules=["head"])
    assert callback.config == QATConfig("int8_weight_only", start_step=5, skip_modules=("head",))
