"""FSDP checkpoints: tell a sharded (``torch.distributed.checkpoint``) folder apart, consolidate it, load it.

``LowMemoryFSDPStrategy`` saves one consolidated file by default (the full state dict, gathered on
rank 0: it loads on one process, with any strategy, e.g. for post-training quantization or export).
With ``save_distributed_checkpoint=True`` each rank writes its shard into a folder instead; only the
FSDP strategy reads that back (on any world size). :func:`consolidate_checkpoint` turns such a folder
into the one-file format, in one process, without a process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_lowmem.checkpoints.records import SHARDED_HINT, is_sharded_checkpoint, reject_sharded_checkpoint

__all__ = [
    "SHARDED_HINT",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "load_sharded_checkpoint",
    "reject_sharded_checkpoint",
]


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

    from lightning_lowmem._compat.lightning_internals import lightning_sharded_checkpoint_reader

    metadata_filename, load_distributed_checkpoint = lightning_sharded_checkpoint_reader()

    if not is_sharded_checkpoint(path):
        raise ValueError(f"`path`={str(path)!r} is not a sharded checkpoint folder (no .metadata file in it)")
    path = Path(path)
    state = load_distributed_checkpoint(path)
    checkpoint: dict[str, Any] = {}
    if (path / metadata_filename).is_file():
        checkpoint.update(torch.load(path / metadata_filename, weights_only=False))
    checkpoint["state_dict"] = state.pop("state_dict")
    optimizers = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_rekey_optimizer_state(state.pop(k)) for k in optimizers]
    if output is not None:
        torch.save(checkpoint, output)
    return checkpoint


def load_sharded_checkpoint(
    path: Any, module: Any, optimizers: list[Any], strict: bool = True, weights_only: bool | None = None
) -> dict[str, Any]:
    """Load a sharded folder into an FSDP2 ``module`` and its ``optimizers``, on any number of processes.

    A collective: every rank calls it. Each rank reads the slices of the saved tensors its own shards
    cover (``torch.distributed.checkpoint`` reshards when the world size differs). Unlike Lightning's
    loader, ``strict=False`` loads a folder that lacks some weights (an adapters-only ``LowRankAdapters``
    checkpoint): those keep their current values. Low-bit optimizer moments are saved dequantized; they
    are read into plain tensors here and quantized again by the caller.

    Args:
        path: the folder.
        module: the sharded LightningModule.
        optimizers: its optimizers, in order (``optimizer_0``, ...).
        strict: a weight of ``module`` missing from the folder (or a saved one ``module`` lacks) is an error.
        weights_only: passed to ``torch.load`` for the Trainer's metadata (``meta.pt``).

    Returns:
        The checkpoint's other contents (loops, callbacks, epoch, ...), as ``Strategy.load_checkpoint`` does.

    Raises:
        KeyError: ``strict`` and the weights differ (names both sides); an optimizer the folder has no
            state for.
    """
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    saved = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    weights = get_model_state_dict(module)
    missing = [k for k in weights if f"state_dict.{k}" not in saved]
    unexpected = sorted(k[len("state_dict.") :] for k in saved if k.startswith("state_dict.") and k[11:] not in weights)
    if strict and (missing or unexpected):
        raise KeyError(
            f"`ckpt_path`={str(path)!r} does not hold the weights of {type(module).__name__}: missing "
            f"{len(missing)} (e.g. {missing[:3]}), unexpected {len(unexpected)} (e.g. {unexpected[:3]}). Load "
            "it into the model that saved it, or set `strict_loading = False` on the LightningModule to keep "
            "the missing ones as they are (LowRankAdapters does for adapters-only checkpoints)."
        )
    weights = {k: v for k, v in weights.items() if k not in missing}
    load({"state_dict": weights}, checkpoint_id=path)
    set_model_state_dict(module, weights, options=StateDictOptions(strict=False))
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        if not any(name.startswith(f"{key}.") for name in saved):
            raise KeyError(
                f"`ckpt_path`={str(path)!r} holds no state for optimizer {index} ({type(optimizer).__name__})"
            )
        state = _plain_moments(get_optimizer_state_dict(module, optimizer))  # creates the state to load into
        load({key: state}, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=StateDictOptions(strict=strict))
    from lightning_lowmem._compat.lightning_internals import lightning_sharded_checkpoint_reader

    return torch.load(path / lightning_sharded_checkpoint_reader()[0], weights_only=weights_only)


def _plain_moments(state: dict[str, Any]) -> dict[str, Any]:
    """A low-bit (torchao) moment replaced by a plain fp32 tensor of its shape (what the folder holds)."""
    import torch
    from torch.distributed.tensor import DTensor

    def plain(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        local = value.to_local() if isinstance(value, DTensor) else value
        if not (hasattr(local, "codes") and hasattr(local, "qmap")):
            return value
        zeros = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
        if not isinstance(value, DTensor):
            return zeros
        return DTensor.from_local(
            zeros, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )

    return {
        "state": {name: {k: plain(v) for k, v in entry.items()} for name, entry in state["state"].items()},
        "param_groups": state["param_groups"],
    }
