"""One reader for every checkpoint file of the package: :func:`read_checkpoint`.

``CompressedCheckpointIO.load_checkpoint``, :func:`~lightning_lowmem.checkpoints.load_quantized_checkpoint`
and users all read through it, so a file written by ``CompressedCheckpointIO`` (framed, sparse-packed) and a
plain ``torch.save`` file load the same way, under any ``map_location``:

- ``None``: CPU (Lightning moves the weights where the model is);
- a device or string: every tensor there, the unpacked sparse ones included;
- a dict ``{saved: target}`` or a callable ``(storage, location) -> storage | None``, with ``torch.load``'s
  meaning, Lightning's ``lambda storage, loc: storage`` included; sparse tensors are placed by the same rule,
  from the device they were saved on. Quantized tensors written by the quantization callbacks (portable, see
  :mod:`~lightning_lowmem.functional.quantization.serialization`) go through every ``map_location``; older
  torchao-pickled ones cannot be rebuilt under a callable and are loaded on CPU instead.

Nothing here imports Lightning.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from lightning_lowmem.checkpoints.file_format import MAGIC, PREFIX, corrupt, is_framed, read_framed
from lightning_lowmem.functional.pruning.sparse_format import unpack_sparse_tree

__all__ = ["read_checkpoint", "read_records", "target_device"]


def target_device(map_location: Any, saved: str) -> torch.device:
    """Where ``torch.load(map_location=map_location)`` puts a tensor saved on ``saved`` (``None``: CPU).

    Example::

        >>> target_device(None, "cuda:0"), target_device({"cuda:1": "cpu"}, "cuda:1")
        (device(type='cpu'), device(type='cpu'))
        >>> target_device(lambda storage, loc: storage, "cuda:0")  # Lightning's default: stays on CPU
        device(type='cpu')
    """
    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(saved, saved))
    # a callable, as torch calls it: a CPU storage and the saved location; None means "where it was saved"
    result = map_location(torch.UntypedStorage(0), saved)
    return torch.device(saved) if result is None else result.device


def _check_map_location(map_location: Any) -> None:
    if map_location is None or isinstance(map_location, (str, torch.device, dict)) or callable(map_location):
        return
    raise TypeError(
        f"`map_location`={map_location!r} is not supported: pass None, a device, a string, a dict or a callable "
        "(as for torch.load)"
    )


def read_checkpoint(path: Any, map_location: Any = None, weights_only: bool = True) -> Any:
    """Load a checkpoint written by ``CompressedCheckpointIO`` or by ``torch.save``.

    Args:
        path: the file (local or any fsspec URL).
        map_location: where tensors go, as for ``torch.load``; see the module docstring. Default: ``None`` (CPU).
        weights_only: as for ``torch.load``. Default: ``True``.

    Returns:
        The checkpoint, packed sparse tensors rebuilt (tensors that shared data share it again).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointCorruptError: the file is truncated or damaged (names the file and what is wrong).
        TypeError: ``map_location`` of an unsupported type.

    Example::

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "plain.ckpt")
        >>> torch.save({"state_dict": {"w": torch.ones(2)}}, path)
        >>> read_checkpoint(path, map_location=lambda storage, loc: storage)["state_dict"]["w"]
        tensor([1., 1.])
    """
    from fsspec.core import url_to_fs

    _check_map_location(map_location)
    fs = url_to_fs(str(path))[0]
    if not fs.exists(str(path)):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    with fs.open(str(path), "rb") as handle:
        if not is_framed(handle.read(len(PREFIX) + len(MAGIC))):  # a plain torch.save file
            handle.seek(0)
            checkpoint = _torch_load(handle, path, map_location, weights_only)
        else:
            handle.seek(0)
            raw = read_framed(handle.read(), path)
            checkpoint = _torch_load(io.BytesIO(raw), path, map_location, weights_only)
    return unpack_sparse_tree(checkpoint, lambda saved: target_device(map_location, saved))


def read_records(path: Any) -> dict[str, dict[str, Any]]:
    """The provenance records (:func:`~lightning_lowmem.checkpoints.records.records`) of the checkpoint at ``path``:
    which lowmem component wrote what, e.g. ``{"LowRankAdapters": {"format": "adapters-only", "r": 4, ...}}``.

    A local plain file is memory-mapped (its tensors are not read); a compressed file is read whole. Empty when
    the file holds no records, is not a local file or folder, or cannot be read with ``weights_only=True``
    (Lightning's own loading then reports what is wrong).

    Example::

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "adapters.ckpt")
        >>> torch.save({"state_dict": {}, "lightning_lowmem": {"writers": {"LowRankAdapters": {"r": 4}}}}, path)
        >>> read_records(path)
        {'LowRankAdapters': {'r': 4}}
    """
    from pathlib import Path

    from lightning_lowmem.checkpoints.records import records

    if not Path(str(path)).is_file():
        return {}
    try:
        with open(path, "rb") as handle:
            framed = is_framed(handle.read(len(PREFIX) + len(MAGIC)))
        if framed:
            checkpoint = read_checkpoint(path)
        else:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not ours to report: Lightning's loading says what is wrong with the file
        return {}
    return records(checkpoint)


def _torch_load(source: Any, path: Any, map_location: Any, weights_only: bool) -> Any:
    map_location = "cpu" if map_location is None else map_location
    try:
        return torch.load(source, map_location=map_location, weights_only=weights_only)
    except Exception as err:
        message = str(err)
        if "Callable map_location not supported" in message:  # torchao-pickled tensor subclasses: rebuild on CPU
            source.seek(0)
            return torch.load(source, map_location="cpu", weights_only=weights_only)
        if "weights_only" in message or "Weights only" in message or isinstance(err, MemoryError):
            raise
        first_line = message.splitlines()[0] if message else ""
        raise corrupt(path, f"torch.load failed ({type(err).__name__}: {first_line})") from err
