"""The per-technique configs and TrainingConfig: validated once, shorthands, equality, round trip."""

from __future__ import annotations

import pytest

from lightning_lowmem.functional.config import (
    CheckpointingConfig,
    CompressionConfig,
    LoRAConfig,
    MicrobatchConfig,
    OptimizerConfig,
    PrecisionConfig,
    QuantizationConfig,
    ShardingConfig,
    TrainingConfig,
)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (
            lambda: PrecisionConfig("bf16"),
            ValueError,
            r"`precision`='bf16' is not a known preset; choose one of .*Did you mean 'bf16-true'\?",
        ),
        (lambda: CheckpointingConfig(0), ValueError, r"`policy`=0 must be >= 1"),
        (
            lambda: CheckpointingConfig("auto", nested="yes"),
            TypeError,
            r"`nested` must be True or False, got str: 'yes'",
        ),
        (
            lambda: CompressionConfig("int4"),
            ValueError,
            r"`mode`='int4' is unknown; choose one of \['bf16', 'int8', 'cpu'\].*Did you mean 'int8'\?",
        ),
        (lambda: CompressionConfig("int8", min_bytes=-1), ValueError, r"`min_bytes`=-1 must be >= 0"),
        (
            lambda: CompressionConfig("int8", min_bytes="64KiB"),
            TypeError,
            r"`min_bytes` must be an int \(bytes\), got str",
        ),
        (
            lambda: OptimizerConfig("adamw_8bit"),
            ValueError,
            r"`optimizer`='adamw_8bit' is unknown; choose one of .*did you mean 'adamw8bit'\?",
        ),
        (
            lambda: OptimizerConfig("adamw8bit", betaz=(0.9, 0.99)),
            ValueError,
            r"`betaz` is not an argument of optimizer 'adamw8bit'; did you mean 'betas'\?",
        ),
        (
            lambda: OptimizerConfig("adamw", betas=[0.9, 1.5]),
            ValueError,
            r"`betas` must be two numbers in \[0, 1\), e.g. \[0.9, 0.999\], got \(0.9, 1.5\)",
        ),
        (
            lambda: OptimizerConfig("adamw", {"lr": 0.1}, lr=0.2),
            ValueError,
            r"`lr` is given twice \(0.1 in optimizer_kwargs, 0.2\)",
        ),
        (
            lambda: OptimizerConfig("sgd", momentum=0.0, nesterov=True),
            ValueError,
            r"OptimizerConfig\('sgd'\) refuses .*Nesterov",
        ),
        (
            lambda: OptimizerConfig("adamw", [("lr", 1)]),
            ValueError,
            r"`optimizer_kwargs`=\[\('lr', 1\)\] must be a mapping",
        ),
        (lambda: MicrobatchConfig(0), ValueError, r"`micro_batch_size` must be a positive int or None, got 0"),
        (lambda: MicrobatchConfig(True), ValueError, r"`micro_batch_size` must be a positive int or None, got True"),
        (lambda: LoRAConfig(r=0), ValueError, r"`r` \(adapter rank\) must be an int > 0, got 0"),
        (lambda: LoRAConfig(quantize_base="fp4"), ValueError, r"`quantize_base` must be one of .*got 'fp4'"),
        (lambda: LoRAConfig(target=[]), ValueError, r"`target` must be a non-empty list"),
        (
            lambda: LoRAConfig(quantize_frozen=True),
            ValueError,
            r"`quantize_frozen`=True must be a bool and needs `quantize_base`",
        ),
        (
            lambda: QuantizationConfig("int9_weight_only"),
            ValueError,
            r"`mode`='int9_weight_only' is not a known quantization mode.*Did you mean 'int8_weight_only'\?",
        ),
        (
            lambda: QuantizationConfig(8),
            TypeError,
            r"`quantization` must be a mode name or a torchao config object.*got int: 8",
        ),
        (
            lambda: QuantizationConfig("int8_weight_only", group_size=0),
            ValueError,
            r"`group_size` must be a positive int \(e.g. 32, 64, 128\), got 0",
        ),
        (
            lambda: ShardingConfig("fdsp"),
            ValueError,
            r"`sharding`='fdsp' is unknown; choose None, 'ddp', 'zero1' or 'fsdp'. Did you mean 'fsdp'\?",
        ),
        (lambda: ShardingConfig("fsdp", world_size=0), ValueError, r"`world_size`=0 must be an int >= 1"),
    ],
)
def test_each_config_refuses_bad_input(build, error, match):
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # a shorthand's error names the argument the user wrote
        ({"activation_compression": "zip"}, ValueError, r"`activation_compression`='zip' is unknown"),
        (
            {"activation_compression": "int8", "compression_min_bytes": -1},
            ValueError,
            r"`compression_min_bytes`=-1 must be >= 0",
        ),
        ({"activation_checkpointing": 0}, ValueError, r"`activation_checkpointing`=0 must be >= 1"),
        (
            {"activation_checkpointing": "auto", "nested_checkpointing": 1},
            TypeError,
            r"`nested_checkpointing` must be True or False",
        ),
        ({"nested_checkpointing": True}, ValueError, r"`nested_checkpointing`=True needs `activation_checkpointing`"),
        (
            {"micro_batch_size": 4, "microbatch": 2},
            ValueError,
            r"`micro_batch_size`=4 and `microbatch`=2 set the same technique",
        ),
        (
            {"optimizer": None, "optimizer_kwargs": {"lr": 1}},
            ValueError,
            r"`optimizer_kwargs`=\{'lr': 1\} needs `optimizer` as a name",
        ),
        ({"lora": "r8"}, TypeError, r"`lora`='r8' must be a LoRAConfig, a mapping of apply_lora_ arguments"),
        (
            {"sharding": ShardingConfig("fsdp", 8), "world_size": 4},
            ValueError,
            r"`world_size`=4 disagrees with `sharding`",
        ),
    ],
)
def test_training_config_shorthands_refuse_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        TrainingConfig(**kwargs)


def test_shorthands_build_the_per_technique_configs_and_compare_by_value():
    config = TrainingConfig(
        precision="bf16-true",
        activation_checkpointing=["Block", "*.attn"],
        nested_checkpointing=True,
        activation_compression="int8",
        compression_min_bytes=0,
        optimizer="AdamW8bit",
        optimizer_kwargs={"betas": [0.9, 0.99]},
        micro_batch_size=4,
        lora={"r": 4, "target": ["c_attn"]},
    )
    assert config.precision == PrecisionConfig("bf16-true") and config.precision.true_dtype is not None
    assert config.checkpointing == CheckpointingConfig(("Block", "*.attn"), nested=True)
    assert config.compression == CompressionConfig("int8", min_bytes=0)
    assert config.optimizer == OptimizerConfig("adamw8bit", betas=(0.9, 0.99))  # YAML lists become tuples
    assert config.microbatch == MicrobatchConfig(4) and config.lora == LoRAConfig(r=4, target=("c_attn",))
    assert config == TrainingConfig(**config.to_dict())  # the flat dict round-trips
    assert len({config, TrainingConfig(**config.to_dict())}) == 1  # hashable: the planner keys on it
    assert config.describe() == "bf16-true + lora(r=4) + ckpt([Block, *.attn]) + int8 acts + adamw8bit + mb 4"
    assert TrainingConfig(lora=(("r", 4),)).lora == LoRAConfig(r=4)  # the pairs earlier versions stored
    assert config.replace(micro_batch_size=None).microbatch is None
    sharded = TrainingConfig(sharding="fsdp", world_size=8)
    assert sharded.sharding == ShardingConfig("fsdp", 8) and sharded.to_dict()["world_size"] == 8


def test_quantization_accepts_a_mode_name_or_a_torchao_config():
    torchao = pytest.importorskip("torchao.quantization")
    by_object = QuantizationConfig(torchao.Int8WeightOnlyConfig())
    assert by_object == QuantizationConfig(torchao.Int8WeightOnlyConfig()) != QuantizationConfig("int8_weight_only")
    assert by_object.torchao_config() is by_object.mode and by_object.name == "Int8WeightOnlyConfig"
    assert TrainingConfig(quantization="int8_weight_only").quantization.name == "int8_weight_only"


def test_the_estimate_module_re_exports_the_one_training_config():
    from lightning_lowmem.planning.estimate import TrainingConfig as FromEstimate

    assert FromEstimate is TrainingConfig
