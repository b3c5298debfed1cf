"""Lightning's private helpers: ModelParallelStrategy's setup steps and sharded-checkpoint reader, the
multiprocessing launcher.

Each function names the private name it uses (of torch, Lightning, transformers or torchao) and why no public
API does the job.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "lightning_model_parallel_setup_steps",
    "lightning_multiprocessing_launcher",
    "lightning_sharded_checkpoint_reader",
]


def lightning_model_parallel_setup_steps() -> tuple[Any, Any]:
    """Lightning's ``_materialize_distributed_module`` and ``_optimizers_to_device``.

    Why private: ``LowMemoryFSDPStrategy.setup`` repeats ``ModelParallelStrategy.setup`` with the sharding
    done by the strategy instead of the user's ``configure_model`` (the parent's ``setup`` rejects a
    module without that hook); these are the two helpers the parent's ``setup`` calls.
    """
    from lightning.fabric.utilities.init import _materialize_distributed_module
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    return _materialize_distributed_module, _optimizers_to_device


def lightning_sharded_checkpoint_reader() -> tuple[str, Any]:
    """Lightning's name for the Trainer metadata file of a sharded checkpoint folder (``"meta.pt"``) and its
    reader of the folder's tensors (``_load_distributed_checkpoint``).

    Why private: ``lightning.fabric.utilities.load`` keeps both private; ``consolidate_checkpoint`` reads a
    folder Lightning's ``ModelParallelStrategy`` layout wrote, so it must use Lightning's names for it.
    """
    from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint

    return _METADATA_FILENAME, _load_distributed_checkpoint


def lightning_multiprocessing_launcher() -> Any:
    """Lightning's multiprocessing launcher class (``spawn`` / ``fork`` / ``forkserver``).

    Why private: ``_MultiProcessingLauncher`` is how ``DDPStrategy(start_method="spawn")`` starts processes;
    ``ModelParallelStrategy`` offers only the script launcher (re-running the command), which cannot
    work from a notebook or a test. ``LowMemoryFSDPStrategy`` subclasses it to hand the full state dict
    back to the main process (see ``strategies/fsdp.py``).
    """
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    return _MultiProcessingLauncher
