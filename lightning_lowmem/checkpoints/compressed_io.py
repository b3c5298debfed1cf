"""`CompressedCheckpointIO`: zstd / lz4-compressed, sparse-aware, crash-safe checkpoints.

The file layout is :mod:`~lightning_lowmem.checkpoints.file_format`; loading is
:func:`~lightning_lowmem.checkpoints.reading.read_checkpoint`, shared with ``load_quantized_checkpoint``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Union

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import CheckpointIO
from typing_extensions import override

from lightning_lowmem._compat import tree_leaves
from lightning_lowmem.checkpoints import file_format
from lightning_lowmem.checkpoints.file_format import (
    CODECS,
    CheckpointCorruptError,
    codec_module,
    framed_pieces,
    framed_size,
    pack_chunks,
    samples_say_plain,
    written_by_CompressedCheckpointIO,
)
from lightning_lowmem.checkpoints.reading import read_checkpoint
from lightning_lowmem.functional.pruning.sparse_format import pack_sparse_tree

__all__ = [
    "CODECS",
    "CheckpointCorruptError",
    "CompressedCheckpointIO",
    "checkpoint_sizes",
    "written_by_CompressedCheckpointIO",
]

PathLike = Union[str, Path]
"""A checkpoint path, as Lightning's ``CheckpointIO`` takes it (the same type as its private ``_PATH``)."""


class CompressedCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes smaller checkpoints and never leaves a half-written one.

    On save: tensors that are mostly zeros (pruned weights, their optimizer state) are stored as a bitmask
    plus their non-zero values (:mod:`lightning_lowmem.functional.pruning.sparse_format`); the ``torch.save`` bytes
    are cut in 1 MiB chunks, each compressed with zstd or lz4 where that saves at least ``min_saving`` of it
    (samples decide) and stored raw otherwise, so dense weights (random float mantissas, ~8% gain)
    cost no compression time. When nothing was packed and compression would not shrink the whole file by
    ``min_saving`` either, the plain ``torch.save`` file is written, byte for byte ``TorchCheckpointIO``'s (it loads
    without this plugin): the file is never larger than ``TorchCheckpointIO``'s. The file
    is written to a temporary file in the same directory and renamed over the target (``os.replace`` is
    atomic), so a process killed mid-save (``kill -9``, OOM killer, preemption) leaves the previous
    checkpoint intact; ``fsync=True`` also survives power loss.

    A compressed file starts with a few bytes that a plain ``torch.load`` refuses with a message naming this
    plugin, then a header with the raw length and CRC-32: a truncated or damaged file raises
    :class:`CheckpointCorruptError` naming the file. Plain ``torch.save`` checkpoints load too (damaged ones
    raise the same error). Loading (:func:`~lightning_lowmem.checkpoints.reading.read_checkpoint`) uses
    ``torch.load(weights_only=True)`` unless asked otherwise and follows every ``map_location`` itself, CPU
    when none is given; packed sparse and quantized tensors follow a callable one (Lightning's default) too,
    so quantized checkpoints need no other ``CheckpointIO``.

    Args:
        codec: ``"zstd"`` (best ratio), ``"lz4"`` (fastest) or ``"none"`` (sparse packing and atomic
            writes only). Default: ``"zstd"``.
        level: compression level; ``None`` = the codec's default (zstd 3, lz4 0). Default: ``None``.
        sparse: pack mostly-zero float tensors as bitmask + values. Default: ``True``.
        min_sparsity: share of zeros from which a tensor is packed. Default: 0.3.
        min_numel: tensors with fewer elements stay dense. Default: 1024.
        weights_only: default for ``load_checkpoint`` when Lightning passes ``None``. Default: ``True``.
        min_saving: a chunk is stored compressed only when that saves this share of it; a file without
            sparse tensors is framed only when that saves this share of it. Default: 0.1.
        fsync: flush the file to disk before the rename (durable across power loss; slower). Default: ``False``.

    Raises:
        ValueError: unknown ``codec``; ``min_sparsity`` or ``min_saving`` outside [0, 1]; negative ``min_numel``.
        TypeError: ``level`` is not an int.
        ImportError: the codec's package is missing (with the install command).

    Example::

        >>> import os, tempfile
        >>> checkpoint_io = CompressedCheckpointIO(codec="zstd")
        >>> path = os.path.join(tempfile.mkdtemp(), "last.ckpt")
        >>> weight = torch.zeros(64, 64); weight[0, :8] = 1.0
        >>> checkpoint_io.save_checkpoint({"state_dict": {"weight": weight}, "epoch": 3}, path)
        >>> torch.equal(checkpoint_io.load_checkpoint(path)["state_dict"]["weight"], weight)
        True
    """

    def __init__(
        self,
        codec: str = "zstd",
        level: int | None = None,
        sparse: bool = True,
        min_sparsity: float = 0.3,
        min_numel: int = 1024,
        weights_only: bool = True,
        min_saving: float = 0.1,
        fsync: bool = False,
    ) -> None:
        if codec not in CODECS:
            raise ValueError(f"`codec`={codec!r} is unknown; choose one of {list(CODECS)}")
        if level is not None and (isinstance(level, bool) or not isinstance(level, int)):
            raise TypeError(f"`level` must be an int or None, got {type(level).__name__}: {level!r}")
        if not 0.0 <= min_sparsity <= 1.0:
            raise ValueError(f"`min_sparsity`={min_sparsity} must be in [0, 1] (share of zeros)")
        if not 0.0 <= min_saving <= 1.0:
            raise ValueError(f"`min_saving`={min_saving} must be in [0, 1] (share of a chunk compression must save)")
        if min_numel < 0:
            raise ValueError(f"`min_numel`={min_numel} must be >= 0")
        codec_module(codec)  # fail early with the install hint
        self.codec = codec
        self.level = level if level is not None else {"zstd": 3, "lz4": 0, "none": 0}[codec]
        self.sparse = sparse
        self.min_sparsity = min_sparsity
        self.min_numel = min_numel
        self.weights_only = weights_only
        self.min_saving = min_saving
        self.fsync = fsync
        self.last_save_stats: dict[str, int] = {}

    def checkpoint_reader(self) -> tuple[str, None]:
        """(writer, accept) for :func:`lightning_lowmem.checkpoints.check`: this plugin reads its own files."""
        return "CompressedCheckpointIO", None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        """Pack, compress and atomically write ``checkpoint`` to ``path``.

        Raises:
            TypeError: ``storage_options`` was given (not supported).
        """
        if storage_options is not None:
            raise TypeError(f"`storage_options` is not supported by {type(self).__name__}, got {storage_options!r}")
        packed, num_sparse = (
            pack_sparse_tree(checkpoint, self.min_sparsity, self.min_numel) if self.sparse else (checkpoint, 0)
        )
        if num_sparse == 0 and samples_say_plain(tree_leaves(packed), self.codec, self.level, self.min_saving):
            written = _save_plain(path, packed, self.fsync)  # dense weights: compression would not pay
            chunks = -(-written // file_format.CHUNK_BYTES)
            self.last_save_stats = {"raw_bytes": written, "file_bytes": written, "sparse_tensors": 0, "chunks": chunks}
            self.last_save_stats["chunks_compressed"] = 0
            return
        buffer = io.BytesIO()  # in memory, as TorchCheckpointIO does: a file left plain is byte for byte its file
        torch.save(packed, buffer)
        raw = buffer.getbuffer()
        stored = pack_chunks(raw, self.codec, self.level, self.min_saving)
        plain = num_sparse == 0 and framed_size(stored) > (1 - self.min_saving) * len(raw)  # too little gained
        written = _write_pieces(path, [raw] if plain else framed_pieces(raw, stored, self.codec), self.fsync)
        self.last_save_stats = {
            "raw_bytes": len(raw),
            "file_bytes": written,
            "sparse_tensors": num_sparse,
            "chunks": len(stored),
            "chunks_compressed": sum(c for c, _ in stored),
        }

    @override
    def load_checkpoint(
        self, path: PathLike, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a checkpoint written by this plugin or by ``torch.save``
        (:func:`~lightning_lowmem.checkpoints.reading.read_checkpoint`).

        Args:
            path: the file.
            map_location: as for ``torch.load``, Lightning's callable default included (quantized and packed
                sparse tensors follow it too). Default: ``None`` (CPU; Lightning then moves the weights).
            weights_only: as for ``torch.load``; ``None`` = this plugin's ``weights_only``. Default: ``None``.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            CheckpointCorruptError: the file is truncated or damaged (names the file and what is wrong).
        """
        weights_only = self.weights_only if weights_only is None else weights_only
        return read_checkpoint(path, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: PathLike) -> None:
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)


def _save_plain(path: PathLike, checkpoint: Any, fsync: bool) -> int:
    """``torch.save`` ``checkpoint`` atomically to a local ``path`` through a file handle (the same bytes as into a
    buffer, so TorchCheckpointIO's file), into a buffer written in one go for a remote one."""
    if type(get_filesystem(path)).__name__ == "LocalFileSystem":
        plain = (torch.Tensor, torch.nn.Parameter)  # a subclass's bytes are its own (codec "none" saves any)
        tensors = [t for t in tree_leaves(checkpoint) if type(t) in plain and t.layout == torch.strided]
        storages = {(t.untyped_storage().data_ptr(), t.device): t.untyped_storage().nbytes() for t in tensors}
        size_hint = sum(storages.values()) + 2**20  # each storage once, plus the pickle and zip records
        return file_format.atomic_save(path, lambda handle: torch.save(checkpoint, handle), fsync, size_hint)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return _write_pieces(path, [buffer.getbuffer()], fsync)


def _write_pieces(path: PathLike, pieces: list[Any], fsync: bool) -> int:
    """Write ``pieces`` atomically to a local ``path``, in one go to a remote one (no rename-over there)."""
    fs = get_filesystem(path)
    if type(fs).__name__ == "LocalFileSystem":
        return file_format.atomic_write(path, pieces, fsync)
    payload = b"".join(bytes(piece) for piece in pieces)
    with fs.open(str(path), "wb") as handle:
        handle.write(payload)
    return len(payload)


def checkpoint_sizes(
    checkpoint: dict[str, Any], checkpoint_io: CompressedCheckpointIO, directory: PathLike
) -> dict[str, int]:
    """Bytes of ``checkpoint`` written by ``torch.save`` and by ``checkpoint_io`` (for docs and benchmarks)."""
    plain, compressed = Path(directory) / "plain.ckpt", Path(directory) / "compressed.ckpt"
    torch.save(checkpoint, plain)
    checkpoint_io.save_checkpoint(checkpoint, compressed)
    return {"torch_save_bytes": plain.stat().st_size, "compressed_bytes": compressed.stat().st_size}
