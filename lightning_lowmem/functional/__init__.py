"""Pure ``nn.Module`` transforms, no Lightning import: the techniques the callbacks, the strategies and the
planner apply. One package per technique that has several files (``quantization``, ``pruning``,
``optimizers``, ``lora``); one module otherwise (``checkpointing``, ``compression``, ``fsdp``,
``microbatch``). ``config`` holds the one vocabulary of a technique mix (a frozen config per technique,
composed into ``TrainingConfig``); ``registry`` the handler registered for each config type (the built-ins
in ``handlers``; ``techniques/`` one module per technique added since: its config and handler, found by file);
``applied`` the :func:`apply` that applies one, with its undo handle.

The public transforms are re-exported here and imported on first use (torchao and torch-pruning load only
with the feature that needs them).

Example::

    >>> import torch
    >>> from lightning_lowmem.functional import prune_, sparsity
    >>> layer = torch.nn.Linear(8, 8)
    >>> _ = prune_(layer, 0.5)
    >>> sparsity(layer)
    0.5
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_lowmem._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    # one vocabulary for a technique mix, and the function that applies it
    "TrainingConfig": "lightning_lowmem.functional.config",
    "PrecisionConfig": "lightning_lowmem.functional.config",
    "CheckpointingConfig": "lightning_lowmem.functional.config",
    "CompressionConfig": "lightning_lowmem.functional.config",
    "OptimizerConfig": "lightning_lowmem.functional.config",
    "MicrobatchConfig": "lightning_lowmem.functional.config",
    "LoRAConfig": "lightning_lowmem.functional.config",
    "QuantizationConfig": "lightning_lowmem.functional.config",
    "PruningConfig": "lightning_lowmem.functional.config",
    "QATConfig": "lightning_lowmem.functional.config",
    "ShardingConfig": "lightning_lowmem.functional.config",
    "CrossEntropyConfig": "lightning_lowmem.functional.config",
    "apply": "lightning_lowmem.functional.applied",
    "Applied": "lightning_lowmem.functional.applied",
    "register_technique": "lightning_lowmem.functional.registry",
    "handler_for": "lightning_lowmem.functional.registry",
    "split_batch": "lightning_lowmem.functional.microbatch",
    # checkpointing / compression / sharding
    "checkpoint_": "lightning_lowmem.functional.checkpointing",
    "uncheckpoint_": "lightning_lowmem.functional.checkpointing",
    "compress_activations": "lightning_lowmem.functional.compression",
    "fully_shard_": "lightning_lowmem.functional.fsdp",
    # the output head's loss
    "linear_cross_entropy": "lightning_lowmem.functional.cross_entropy",
    "chunked_cross_entropy": "lightning_lowmem.functional.cross_entropy",
    "chunk_cross_entropy_": "lightning_lowmem.functional.cross_entropy",
    # lora
    "apply_lora_": "lightning_lowmem.functional.lora",
    "merge_lora_": "lightning_lowmem.functional.lora",
    "save_adapters": "lightning_lowmem.functional.lora",
    "load_adapters": "lightning_lowmem.functional.lora",
    # optimizers
    "available_optimizers": "lightning_lowmem.functional.optimizers",
    "build_optimizer": "lightning_lowmem.functional.optimizers",
    # pruning
    "prune_": "lightning_lowmem.functional.pruning",
    "prune_structural_": "lightning_lowmem.functional.pruning",
    "remove_pruning_": "lightning_lowmem.functional.pruning",
    "sparsity": "lightning_lowmem.functional.pruning",
    # quantization
    "quantize_": "lightning_lowmem.functional.quantization",
    "quantize_static": "lightning_lowmem.functional.quantization",
    "prepare_qat_": "lightning_lowmem.functional.quantization",
    "convert_qat_": "lightning_lowmem.functional.quantization",
    "compile_inference": "lightning_lowmem.functional.quantization",
    "quantize_within_tolerance": "lightning_lowmem.functional.quantization",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what the lazy exports resolve to, for IDEs and type checkers
    from lightning_lowmem.functional.applied import Applied, apply
    from lightning_lowmem.functional.config import (
        CheckpointingConfig,
        CompressionConfig,
        CrossEntropyConfig,
        LoRAConfig,
        MicrobatchConfig,
        OptimizerConfig,
        PrecisionConfig,
        PruningConfig,
        QATConfig,
        QuantizationConfig,
        ShardingConfig,
        TrainingConfig,
    )
    from lightning_lowmem.functional.microbatch import split_batch
    from lightning_lowmem.functional.registry import handler_for, register_technique
    from lightning_lowmem.functional.checkpointing import checkpoint_, uncheckpoint_
    from lightning_lowmem.functional.compression import compress_activations
    from lightning_lowmem.functional.cross_entropy import (
        chunk_cross_entropy_,
        chunked_cross_entropy,
        linear_cross_entropy,
    )
    from lightning_lowmem.functional.fsdp import fully_shard_
    from lightning_lowmem.functional.lora import apply_lora_, load_adapters, merge_lora_, save_adapters
    from lightning_lowmem.functional.optimizers import available_optimizers, build_optimizer
    from lightning_lowmem.functional.pruning import prune_, prune_structural_, remove_pruning_, sparsity
    from lightning_lowmem.functional.quantization import (
        compile_inference,
        convert_qat_,
        prepare_qat_,
        quantize_,
        quantize_static,
        quantize_within_tolerance,
    )
