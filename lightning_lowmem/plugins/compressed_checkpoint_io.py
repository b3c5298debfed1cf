"""`CompressedCheckpointIO`: zstd / lz4-compressed, sparse-aware, crash-safe checkpoints."""

from __future__ import annotations

import io
import os
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import CheckpointIO
from typing_extensions import override

from lightning_lowmem.functional.sparse_format import pack_sparse_tree, unpack_sparse_tree

__all__ = ["CODECS", "CheckpointCorruptError", "CompressedCheckpointIO"]

CODECS = ("zstd", "lz4", "none")
MAGIC = b"LOWMEMCK"
_HEADER = struct.Struct("<8sB7sQI")  # magic, format version, codec name (padded), raw length, crc32 of raw bytes
_VERSION = 1
_CHUNK_BYTES = 4 * 2**20


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is truncated or damaged."""


def _codec_module(codec: str) -> Any:
    try:
        if codec == "zstd":
            import zstandard

            return zstandard
        if codec == "lz4":
            import lz4.frame

            return lz4.frame
    except ImportError as err:
        raise ImportError(
            f"CompressedCheckpointIO(codec={codec!r}) needs the {'zstandard' if codec == 'zstd' else 'lz4'} package: "
            "pip install 'lightning-lowmem[compress]'"
        ) from err
    return None


def _chunks(data: memoryview, size: int = _CHUNK_BYTES) -> Iterator[memoryview]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def _compress_chunks(raw: memoryview, codec: str, level: int) -> Iterator[bytes]:
    """Yield the compressed stream of ``raw`` piece by piece (so the file is written as it is produced)."""
    if codec == "none":
        yield from (bytes(chunk) for chunk in _chunks(raw))
        return
    if codec == "zstd":
        compressor = _codec_module("zstd").ZstdCompressor(level=level).compressobj()
        for chunk in _chunks(raw):
            yield compressor.compress(chunk)
        yield compressor.flush()
        return
    lz4_frame = _codec_module("lz4")
    compressor = lz4_frame.LZ4FrameCompressor(compression_level=level)
    yield compressor.begin(source_size=len(raw))
    for chunk in _chunks(raw):
        yield compressor.compress(chunk)
    yield compressor.flush()


def _decompress(payload: bytes, codec: str, raw_length: int) -> bytes:
    if codec == "none":
        return payload
    if codec == "zstd":
        return _codec_module("zstd").ZstdDecompressor().decompress(payload, max_output_size=raw_length)
    return _codec_module("lz4").decompress(payload)


class CompressedCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes smaller checkpoints and never leaves a half-written one.

    On save: tensors that are mostly zeros (pruned weights, their optimizer state) are stored as a bitmask
    plus their non-zero values (:mod:`lightning_lowmem.functional.sparse_format`); the ``torch.save`` bytes
    are compressed with zstd or lz4 and written, with a header holding their length and CRC-32, to a
    temporary file in the same directory that is then renamed over the target (``os.replace`` is atomic),
    so a crash mid-save leaves the previous checkpoint intact. On load: the header is checked (a
    truncated or damaged file raises :class:`CheckpointCorruptError` naming the file), sparse tensors are
    rebuilt dense, and plain ``torch.save`` checkpoints load too. Loading uses ``torch.load(weights_only=True)``
    unless the caller asks otherwise.

    Args:
        codec: ``"zstd"`` (best ratio), ``"lz4"`` (fastest) or ``"none"`` (sparse packing and atomic
            writes only). Default: ``"zstd"``.
        level: compression level; ``None`` = the codec's default (zstd 3, lz4 0). Default: ``None``.
        sparse: pack mostly-zero float tensors as bitmask + values. Default: ``True``.
        min_sparsity: share of zeros from which a tensor is packed. Default: 0.3.
        min_numel: tensors with fewer elements stay dense. Default: 1024.
        weights_only: default for ``load_checkpoint`` when Lightning passes ``None``. Default: ``True``.

    Raises:
        ValueError: unknown ``codec``; ``min_sparsity`` outside [0, 1]; negative ``min_numel``.
        TypeError: ``level`` is not an int.
        ImportError: the codec's package is missing (with the install command).

    Example::

        >>> import tempfile
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
    ) -> None:
        if codec not in CODECS:
            raise ValueError(f"`codec`={codec!r} is unknown; choose one of {list(CODECS)}")
        if level is not None and (isinstance(level, bool) or not isinstance(level, int)):
            raise TypeError(f"`level` must be an int or None, got {type(level).__name__}: {level!r}")
        if not 0.0 <= min_sparsity <= 1.0:
            raise ValueError(f"`min_sparsity`={min_sparsity} must be in [0, 1] (share of zeros)")
        if min_numel < 0:
            raise ValueError(f"`min_numel`={min_numel} must be >= 0")
        _codec_module(codec)  # fail early with the install hint
        self.codec = codec
        self.level = level if level is not None else {"zstd": 3, "lz4": 0, "none": 0}[codec]
        self.sparse = sparse
        self.min_sparsity = min_sparsity
        self.min_numel = min_numel
        self.weights_only = weights_only
        self.last_save_stats: dict[str, int] = {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Pack, compress and atomically write ``checkpoint`` to ``path``.

        Raises:
            TypeError: ``storage_options`` was given (not supported).
        """
        if storage_options is not None:
            raise TypeError(f"`storage_options` is not supported by {type(self).__name__}, got {storage_options!r}")
        packed, num_sparse = pack_sparse_tree(checkpoint, self.min_sparsity, self.min_numel) if self.sparse else (checkpoint, 0)
        buffer = io.BytesIO()
        torch.save(packed, buffer)
        raw = buffer.getbuffer()
        codec_name = self.codec.encode().ljust(7, b"\0")
        header = _HEADER.pack(MAGIC, _VERSION, codec_name, len(raw), zlib.crc32(raw))
        written = _atomic_write(path, header, _compress_chunks(raw, self.codec, self.level))
        self.last_save_stats = {"raw_bytes": len(raw), "file_bytes": written, "sparse_tensors": num_sparse}
        del raw
        buffer.close()

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a checkpoint written by this plugin or by ``torch.save``.

        Args:
            path: the file.
            map_location: as for ``torch.load``. Default: ``None`` (tensors where they were saved; sparse
                tensors on CPU).
            weights_only: as for ``torch.load``; ``None`` = this plugin's ``weights_only``. Default: ``None``.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            CheckpointCorruptError: the file is truncated or damaged (names the file and what is wrong).
        """
        weights_only = self.weights_only if weights_only is None else weights_only
        fs = get_filesystem(path)
        if not fs.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        with fs.open(path, "rb") as handle:
            data = handle.read()
        if data[: len(MAGIC)] != MAGIC:  # a plain torch.save checkpoint
            return unpack_sparse_tree(_torch_load(data, path, map_location, weights_only))
        if len(data) < _HEADER.size:
            raise CheckpointCorruptError(f"checkpoint {str(path)!r} is truncated: {len(data)} bytes, shorter than its header")
        _, version, codec_name, raw_length, crc = _HEADER.unpack_from(data)
        codec = codec_name.rstrip(b"\0").decode(errors="replace")
        if version != _VERSION or codec not in CODECS:
            raise CheckpointCorruptError(
                f"checkpoint {str(path)!r} has an unknown format (version {version}, codec {codec!r}); "
                f"this lightning_lowmem reads version {_VERSION} with codecs {list(CODECS)}"
            )
        try:
            raw = _decompress(data[_HEADER.size :], codec, raw_length)
        except Exception as err:  # each codec raises its own error type on damaged input
            raise CheckpointCorruptError(
                f"checkpoint {str(path)!r} is truncated or damaged: {codec} could not decompress it "
                f"({type(err).__name__}: {err}). The file has {len(data)} bytes; delete it or load an earlier checkpoint."
            ) from err
        if len(raw) != raw_length or zlib.crc32(raw) != crc:
            raise CheckpointCorruptError(
                f"checkpoint {str(path)!r} is truncated or damaged: expected {raw_length} bytes with CRC-32 {crc:#010x}, "
                f"got {len(raw)} bytes with CRC-32 {zlib.crc32(raw):#010x}"
            )
        del data
        return unpack_sparse_tree(_torch_load(raw, path, map_location, weights_only))

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)


def _torch_load(raw: bytes, path: _PATH, map_location: Any, weights_only: bool) -> Any:
    try:
        return torch.load(io.BytesIO(raw), map_location=map_location, weights_only=weights_only)
    except (RuntimeError, EOFError) as err:
        if "weights_only" in str(err) or "Weights only" in str(err):
            raise
        raise CheckpointCorruptError(
            f"checkpoint {str(path)!r} is truncated or damaged: torch.load failed ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        ) from err


def _atomic_write(path: _PATH, header: bytes, chunks: Iterator[bytes]) -> int:
    """Write ``header`` + ``chunks`` to a temporary file next to ``path``, fsync, and rename it over ``path``.

    Returns:
        Bytes written. On any error the temporary file is removed and ``path`` is untouched.
    """
    fs = get_filesystem(path)
    if type(fs).__name__ != "LocalFileSystem":  # remote stores have no rename-over; write in one go
        payload = header + b"".join(chunks)
        with fs.open(str(path), "wb") as handle:
            handle.write(payload)
        return len(payload)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    written = 0
    try:
        with open(temporary, "wb") as handle:
            handle.write(header)
            written += len(header)
            for chunk in chunks:
                handle.write(chunk)
                written += len(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return written


def checkpoint_sizes(checkpoint: dict[str, Any], checkpoint_io: CompressedCheckpointIO, directory: _PATH) -> dict[str, int]:
    """Bytes of ``checkpoint`` written by ``torch.save`` and by ``checkpoint_io`` (for docs and benchmarks)."""
    plain, compressed = Path(directory) / "plain.ckpt", Path(directory) / "compressed.ckpt"
    torch.save(checkpoint, plain)
    checkpoint_io.save_checkpoint(checkpoint, compressed)
    return {"torch_save_bytes": plain.stat().st_size, "compressed_bytes": compressed.stat().st_size}

