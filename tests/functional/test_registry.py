"""The registry of techniques: complete (every config a handler, every handler a config and a field), and a
technique registered from outside (a config and a handler, nothing else) applied, composed, shown and undone."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

import lightning_lowmem.functional.config as config_package
from lightning_lowmem.functional.applied import apply
from lightning_lowmem.functional.config import (
    CheckpointingConfig,
    CompressionConfig,
    CrossEntropyConfig,
    LoRAConfig,
    MicrobatchConfig,
    PruningConfig,
    QuantizationConfig,
    ShardingConfig,
    TrainingConfig,
)
from lightning_lowmem.functional.techniques import technique_modules
from lightning_lowmem.functional.registry import (
    handler_for,
    register_technique,
    technique,
    techniques,
    unregister_technique,
)

CONFIG_TYPES = [getattr(config_package, name) for name in config_package.__all__ if name.endswith("Config")]


def test_every_config_has_a_handler_and_every_handler_a_config_and_a_field():
    technique_configs = [kind for kind in CONFIG_TYPES if kind is not TrainingConfig]  # however many there are
    for kind in technique_configs:
        assert callable(handler_for(kind)), kind
    registered = techniques()
    # a built-in's config is in the config package, or in the technique's own module (functional/techniques/)
    in_package = [t for t in registered if t.config_type.__module__.startswith(config_package.__name__)]
    assert sorted(t.config_type.__name__ for t in in_package) == sorted(k.__name__ for k in technique_configs)
    own_module = {t.config_type.__module__ for t in registered} - {t.config_type.__module__ for t in in_package}
    assert own_module <= set(technique_modules())
    assert {t.handler.__module__ for t in registered if t not in in_package} == own_module  # config and handler
    # TrainingConfig's keywords and attributes are the registry's (#35): nothing spelt again there
    assert list(TrainingConfig.keywords()) == [t.field for t in registered]
    config = TrainingConfig()
    assert [name for name in TrainingConfig.keywords() if getattr(config, name) is not None] == [
        "precision",
        "optimizer",
    ]


def test_built_ins_apply_in_the_documented_order():
    order = {t.config_type: t.order for t in techniques()}
    chain = [QuantizationConfig, LoRAConfig, CheckpointingConfig, CrossEntropyConfig, CompressionConfig]
    assert [order[kind] for kind in chain] == sorted(order[kind] for kind in chain)  # the numbers: handlers.py
    assert technique("microbatch").flat == ("micro_batch_size",)
    assert technique("checkpointing").flat == ("activation_checkpointing", "nested_checkpointing")


# ----------------------------------------------------------------------------- a toy technique, from outside
@dataclass(frozen=True)
class ScaleConfig:
    """Multiply every ``nn.Linear`` weight by ``factor`` (a toy technique)."""

    factor: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.factor, (int, float)) or self.factor <= 0:
            raise ValueError(f"`factor`={self.factor!r} must be a number > 0, e.g. 2.0")


class _Counter:
    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def enter(self):
        self.count += 1
        yield


_ENTERED = _Counter()


def _scale_shorthand(value, *, scale_factor=None):
    if scale_factor is not None:
        return ScaleConfig(scale_factor)
    return {"factor": value} if isinstance(value, (int, float)) else value


@pytest.fixture
def scale_technique():
    @register_technique(
        ScaleConfig,
        field="scale",
        order=5,  # before quantization and LoRA: the adapters wrap the scaled layers
        shorthand=_scale_shorthand,
        label=lambda c: f"x{c.factor:g}" if c is not None else None,
        to_shorthand=lambda c: {"scale_factor": c.factor} if c is not None else {},
        step_context=lambda config, stats: _ENTERED.enter(),
    )
    def scale(module, config, applied):
        layers = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
        originals = [layer.weight.detach().clone() for layer in layers]
        applied.on_undo(lambda: [layer.weight.data.copy_(w) for layer, w in zip(layers, originals, strict=True)])
        for layer in layers:
            layer.weight.data.mul_(config.factor)

    yield scale
    unregister_technique(ScaleConfig)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.ReLU(), torch.nn.Linear(4, 2, bias=False))


def test_a_registered_technique_is_applied_composed_shown_and_undone(scale_technique):
    model, x = _model(), torch.rand(3, 4)
    before_out, before_state = model(x), {k: v.clone() for k, v in model.state_dict().items()}

    config = TrainingConfig(scale=4.0, lora={"r": 2, "target": ["0"]}, micro_batch_size=2)
    assert config.scale == ScaleConfig(4.0) and TrainingConfig().scale is None
    assert config.describe() == "32-true + lora(r=2) + adamw + mb 2 + x4"
    assert config.to_dict()["scale_factor"] == 4.0 and TrainingConfig(**config.to_dict()) == config
    assert config != config.replace(scale_factor=3.0) and config.replace(scale_factor=3.0).scale.factor == 3.0
    assert len({config, TrainingConfig(**config.to_dict())}) == 1

    applied = apply(model, config)
    assert type(model[0]).__name__ == "LoraLinear" and type(model[2]).__name__ == "Linear"
    # two layers scaled by 4, ReLU between: the output is exactly 16 times (the adapters start at zero)
    torch.testing.assert_close(model(x), 16 * before_out, rtol=0, atol=1e-5)
    with applied.step_context():
        pass
    assert _ENTERED.count == 1  # the technique's step-side part ran
    applied.undo()
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before_state.items())
    assert torch.equal(model(x), before_out)
    applied.undo()  # idempotent
    assert torch.equal(model(x), before_out)


def test_apply_takes_one_technique_config_or_a_list(scale_technique):
    model, x = _model(), torch.rand(3, 4)
    before = model(x)
    applied = apply(model, ScaleConfig(3.0))
    torch.testing.assert_close(model(x), 9 * before, rtol=0, atol=1e-5)
    assert applied.config == TrainingConfig(precision=None, optimizer=None, scale=3.0)
    applied.undo()
    applied = apply(model, [ScaleConfig(0.5), MicrobatchConfig(2)])
    torch.testing.assert_close(model(x), 0.25 * before, rtol=0, atol=1e-6)
    assert [len(part) for part in applied.micro_batches(torch.zeros(5))] == [2, 2, 1]
    applied.undo()
    assert torch.equal(model(x), before)


def test_a_failing_handler_undoes_the_ones_before_it(scale_technique):
    model, x = _model(), torch.rand(3, 4)
    before = model(x)
    with pytest.raises(ValueError, match="policy 'NoSuchBlock' matched no submodule"):
        apply(model, TrainingConfig(scale=2.0, activation_checkpointing="NoSuchBlock"))
    assert torch.equal(model(x), before)


def test_registry_errors_name_the_fix(scale_technique):
    with pytest.raises(ValueError, match=r"ScaleConfig is registered already .*unregister_technique first"):
        register_technique(ScaleConfig, field="other", order=1)(lambda m, c, a: None)
    with pytest.raises(ValueError, match=r"keyword 'micro_batch_size' is registered already \(by MicrobatchConfig\)"):
        register_technique(dataclass(frozen=True)(type("Other", (), {})), field="micro_batch_size", order=1)(print)
    with pytest.raises(TypeError, match=r"no technique handler is registered for 'int'.*@register_technique"):
        handler_for(int)
    with pytest.raises(TypeError, match=r"`config` must be a TrainingConfig .* a technique config"):
        apply(_model(), 3)
    with pytest.raises(ValueError, match=r"the 'scale' technique is given more than once"):
        apply(_model(), [ScaleConfig(2.0), ScaleConfig(3.0)])
    with pytest.raises(TypeError, match=r"unknown argument `scale_factr`.*Did you mean 'scale_factor'\?"):
        TrainingConfig(scale_factr=2.0)
    with pytest.raises(ValueError, match=r"`factor`=-1 must be a number > 0"):
        TrainingConfig(scale=-1)


def test_replace_through_a_flat_keyword_keeps_the_techniques_other_settings():
    config = TrainingConfig(sharding="fsdp", world_size=4, activation_compression="int8", compression_min_bytes=0)
    assert config.replace(world_size=8).sharding == ShardingConfig("fsdp", 8)
    assert config.replace(compression_min_bytes=1024).compression == CompressionConfig("int8", min_bytes=1024)
    assert config.replace(activation_compression=None).compression is None


@pytest.mark.parametrize(
    "config",
    [
        TrainingConfig(precision=None, optimizer=None),
        TrainingConfig(quantization=QuantizationConfig("int4_weight_only", group_size=64), lora={"r": 4}),
        TrainingConfig(
            cross_entropy={"chunk_size": 256}, activation_checkpointing=["Block"], nested_checkpointing=True
        ),
        TrainingConfig(sharding="zero1", world_size=4, optimizer="adamw8bit", optimizer_kwargs={"lr": 1e-3}),
        TrainingConfig(activation_compression="cpu", compression_min_bytes=0, micro_batch_size=3),
    ],
    ids=["as-configured", "quantized-lora", "chunked-loss-nested", "sharded-optimizer", "compressed-microbatched"],
)
def test_every_built_in_round_trips_through_to_dict(config):
    assert TrainingConfig(**config.to_dict()) == config


def test_pruning_and_qat_are_techniques_applied_once_and_undone_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    x = torch.randn(4, 64)

    applied = apply(model, PruningConfig(amount=0.5, use_global_unstructured=False, prune_heads=True))
    assert int((model[0].weight == 0).sum()) == 2048 and int((model[2].weight == 0).sum()) == 256  # exactly half
    assert model[0].weight_mask.dtype == torch.bool and applied.pruning is not None
    applied.undo()
    assert model.state_dict().keys() == before.keys()  # the masks are gone
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())  # values back

    float_out = model(x)
    applied = apply(model, TrainingConfig(qat="int8_weight_only"))
    assert applied.qat == ["0", "2"] and type(model[0]).__name__ == "FakeQuantizedLinear"
    assert not torch.equal(model(x), float_out)  # the weights are fake-quantized in the forward
    applied.undo()
    assert type(model[0]) is torch.nn.Linear and torch.equal(model(x), float_out)

    config = TrainingConfig(pruning={"amount": 0.3}, qat="int8_weight_only", optimizer="sgd")
    assert config.to_dict()["pruning"] == {"amount": 0.3} and TrainingConfig(**config.to_dict()) == config
    assert config.describe() == "32-true + sgd + prune(l1_unstructured 0.3) + qat(int8_weight_only)"


@pytest.mark.parametrize("module", technique_modules())
def test_the_built_ins_register_first_whichever_module_is_imported_first(module):
    """``describe()`` / ``to_dict()`` order is the built-ins', then the technique modules' (by file), even when a
    technique module is the first thing imported."""
    import subprocess
    import sys

    code = f"import {module}\nfrom lightning_lowmem.functional.registry import techniques\nprint([t.field for t in techniques()])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([t.field for t in techniques()])
