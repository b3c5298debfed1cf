"""lightning_lowmem: make large models train and ship in small GPU memory, measured.

Public names are imported lazily, so ``import lightning_lowmem`` stays fast and optional dependencies
(torchao, torch-pruning, scikit-learn) load only when the feature that needs them is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lightning_lowmem._lazy import class_exports, lazy_exports

__version__ = "0.1.0.dev0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # memory core
    "MemoryReport": "lightning_lowmem.memory",
    "format_bytes": "lightning_lowmem.memory",
    "mark_memory": "lightning_lowmem.memory",
    "measure_memory": "lightning_lowmem.memory",
    "parse_bytes": "lightning_lowmem.memory",
    "track_memory": "lightning_lowmem.memory",
    "estimate_memory": "lightning_lowmem.planning.estimate",
    "plan_memory": "lightning_lowmem.planning.plan",
    "Plan": "lightning_lowmem.planning.plan",
    "EstimationError": "lightning_lowmem.planning.estimate",
    "TrainingConfig": "lightning_lowmem.functional.config",
    # modules, strategies, plugins
    "DistillationModule": "lightning_lowmem.distillation.module",
    "LowMemoryStrategy": "lightning_lowmem.strategies.low_memory",
    "LowMemoryDDPStrategy": "lightning_lowmem.strategies.low_memory",
    "LowMemoryFSDPStrategy": "lightning_lowmem.strategies.fsdp",
    "CompressedCheckpointIO": "lightning_lowmem.checkpoints.compressed_io",
    "CheckpointCorruptError": "lightning_lowmem.checkpoints.file_format",
    # warnings
    "NoEffectWarning": "lightning_lowmem.warnings",
    "LowMemWarning": "lightning_lowmem.warnings",
    # every callback, found by file: callbacks/<snake_name>.py defines <SnakeName>
    **class_exports("lightning_lowmem.callbacks", Path(__file__).parent / "callbacks"),
}

__all__ = sorted([*_EXPORTS, "__version__"])
__getattr__, _dir = lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # what the lazy exports resolve to, for IDEs and type checkers (a new callback: one line here)
    from lightning_lowmem.callbacks.activation_checkpointing import ActivationCheckpointing
    from lightning_lowmem.callbacks.activation_compression import ActivationCompression
    from lightning_lowmem.callbacks.auto_microbatch import AutoMicrobatch
    from lightning_lowmem.callbacks.chunked_cross_entropy import ChunkedCrossEntropy
    from lightning_lowmem.callbacks.freeze_layers import FreezeLayers
    from lightning_lowmem.callbacks.low_rank_adapters import LowRankAdapters
    from lightning_lowmem.callbacks.memory_efficient_optimizer import MemoryEfficientOptimizer
    from lightning_lowmem.callbacks.memory_monitor import MemoryMonitor
    from lightning_lowmem.callbacks.post_training_quantization import PostTrainingQuantization
    from lightning_lowmem.callbacks.quantization_aware_training import QuantizationAwareTraining
    from lightning_lowmem.callbacks.scheduled_pruning import ScheduledPruning
    from lightning_lowmem.checkpoints.compressed_io import CompressedCheckpointIO
    from lightning_lowmem.checkpoints.file_format import CheckpointCorruptError
    from lightning_lowmem.distillation.module import DistillationModule
    from lightning_lowmem.functional.config import TrainingConfig
    from lightning_lowmem.memory import (
        MemoryReport,
        format_bytes,
        mark_memory,
        measure_memory,
        parse_bytes,
        track_memory,
    )
    from lightning_lowmem.planning.estimate import EstimationError, estimate_memory
    from lightning_lowmem.planning.plan import Plan, plan_memory
    from lightning_lowmem.strategies.fsdp import LowMemoryFSDPStrategy
    from lightning_lowmem.strategies.low_memory import LowMemoryDDPStrategy, LowMemoryStrategy
    from lightning_lowmem.warnings import LowMemWarning, NoEffectWarning

# Trainer(strategy="lowmem" | "lowmem_ddp" | "lowmem_ddp_spawn") after `import lightning_lowmem`, without
# importing Lightning here: registered now if Lightning is loaded, else as soon as it is.
from lightning_lowmem.strategies._registration import register_on_lightning_import  # noqa: E402

register_on_lightning_import()

# torch.load(weights_only=True) of quantized checkpoints after `import lightning_lowmem`, without importing torch
# (or torchao) here: the package's rebuild function is allowlisted now if torch is loaded, else as soon as it is.
from lightning_lowmem._torch_hook import register_on_torch_import  # noqa: E402

register_on_torch_import()

# torchao's import-time log lines (CUDA kernel libraries that cannot load on this machine, torch's deprecation of
# its enum registrations) dropped from the first use of the Python API on, as from the `lowmem` command.
from lightning_lowmem._quiet import quiet_startup_logs  # noqa: E402

quiet_startup_logs()
