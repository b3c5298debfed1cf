"""FSDP checkpoints: tell a sharded (``torch.distributed.checkpoint``) folder apart, and consolidate it.

``LowMemoryFSDPStrategy`` saves one consolidated file by default (the full state dict, gathered on
rank 0: it loads on one process, with any strategy, e.g. for post-training quantization or export).
With ``save_distributed_checkpoint=True`` each rank writes its shard into a folder instead; only the
FSDP strategy reads that back (on any world size). :func:`consolidate_checkpoint` turns such a folder
into the one-file format, in one process, without a process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["SHARDED_HINT", "consolidate_checkpoint", "is_sharded_checkpoint", "reject_sharded_checkpoint"]

SHARDED_HINT = (
    "load it with strategy='lowmem_fsdp' (any number of processes), or consolidate it into one file first: "
    "python -c \"from lightning_lowmem.strategies.fsdp_checkpoint import consolidate_checkpoint; "
    "consolidate_checkpoint('{path}', '{path}.consolidated.ckpt')\""
)


def is_sharded_checkpoint(path: Any) -> bool:
    """True when ``path`` is a folder written by ``torch.distributed.checkpoint`` (holds ``.metadata``)."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def reject_sharded_checkpoint(path: Any, strategy: str) -> None:
    """Raise a ``ValueError`` saying how to consolidate, if ``path`` is a sharded FSDP checkpoint."""
    if path is not None and is_sharded_checkpoint(path):
        raise ValueError(
            f"`ckpt_path`={str(path)!r} is a sharded FSDP checkpoint (a folder of per-rank shards written by "
            f"LowMemoryFSDPStrategy(save_distributed_checkpoint=True)), which {strategy} cannot read: "
            + SHARDED_HINT.format(path=path)
        )


def _rekey_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """Parameter names (DCP's keys) -> positions in the param groups (what ``Optimizer.load_state_dict`` takes)."""
    groups = state.get("param_groups", [])
    order = [name for group in groups for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index.get(name, name): value for name, value in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
    }


def consolidate_checkpoint(path: Any, output: Any = None) -> dict[str, Any]:
    """Read a sharded FSDP checkpoint folder into one full Lightning checkpoint dict (one process).

    Args:
        path: the folder ``LowMemoryFSDPStrategy(save_distributed_checkpoint=True)`` wrote.
        output: also ``torch.save`` the result here (loads with any strategy). Default: ``None``.

    Returns:
        The checkpoint: ``state_dict`` (full tensors), ``optimizer_states`` (keyed by parameter
        position, as a plain optimizer's ``state_dict``) and the Trainer's metadata (loops, callbacks).

    Raises:
        ValueError: ``path`` is not a sharded checkpoint folder.
    """
    import torch
    from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint

    if not is_sharded_checkpoint(path):
        raise ValueError(f"`path`={str(path)!r} is not a sharded checkpoint folder (no .metadata file in it)")
    path = Path(path)
    state = _load_distributed_checkpoint(path)
    checkpoint: dict[str, Any] = {}
    if (path / _METADATA_FILENAME).is_file():
        checkpoint.update(torch.load(path / _METADATA_FILENAME, weights_only=False))
    checkpoint["state_dict"] = state.pop("state_dict")
    optimizers = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_rekey_optimizer_state(state.pop(k)) for k in optimizers]
    if output is not None:
        torch.save(checkpoint, output)
    return checkpoint
