"""One vocabulary for a technique mix: a frozen config per technique, composed into a :class:`TrainingConfig`.

Each config is validated once, in ``__post_init__`` (the torchao pattern): a bad value fails where it is
written, with the argument, the value, what is allowed and a hint. The callbacks, the strategies,
:func:`~lightning_lowmem.planning.estimate.estimate_memory`, :func:`~lightning_lowmem.planning.plan.plan_memory`
and ``lowmem estimate`` all take these objects, and :func:`lightning_lowmem.functional.apply` applies
them, so what is planned is what runs. The flat keyword arguments users know (``optimizer="adamw8bit"``,
``activation_checkpointing="auto"``, ``lora={"r": 8}``) are shorthands that :class:`TrainingConfig` turns
into these configs.

No Lightning import here, and nothing heavy at import time (torchao is only imported to check a torchao
config object).

Example::

    >>> config = TrainingConfig(precision="bf16-true", activation_checkpointing="auto", optimizer="adamw8bit")
    >>> config.checkpointing, config.optimizer.name
    (CheckpointingConfig(policy='auto', nested=False), 'adamw8bit')
    >>> config.describe()
    'bf16-true + ckpt(auto) + adamw8bit'
"""

from lightning_lowmem.functional.config.constants import (
    COMPRESSION_MIN_BYTES,
    COMPRESSION_MODES,
    GROUP_SIZE,
    PRUNING_METHODS,
    QAT_MODES,
    QUANTIZATION_MODES,
)
from lightning_lowmem.functional.config.pruning import PruningConfig
from lightning_lowmem.functional.config.qat import QATConfig
from lightning_lowmem.functional.config.techniques import (
    CROSS_ENTROPY_MODES,
    PRECISIONS,
    SHARDINGS,
    CheckpointingConfig,
    CompressionConfig,
    CrossEntropyConfig,
    LoRAConfig,
    MicrobatchConfig,
    OptimizerConfig,
    PrecisionConfig,
    QuantizationConfig,
    ShardingConfig,
)
from lightning_lowmem.functional.config.training import TrainingConfig

__all__ = [
    "COMPRESSION_MIN_BYTES",
    "COMPRESSION_MODES",
    "CROSS_ENTROPY_MODES",
    "GROUP_SIZE",
    "PRUNING_METHODS",
    "QAT_MODES",
    "QUANTIZATION_MODES",
    "PRECISIONS",
    "SHARDINGS",
    "CheckpointingConfig",
    "CompressionConfig",
    "CrossEntropyConfig",
    "LoRAConfig",
    "MicrobatchConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "PruningConfig",
    "QATConfig",
    "QuantizationConfig",
    "ShardingConfig",
    "TrainingConfig",
]
