"""`CompressedCheckpointIO`: zstd / lz4-compressed, sparse-aware, crash-safe checkpoints."""

from __future__ import annotations

import io
import os
import struct
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import CheckpointIO
from typing_extensions import override

from lightning_lowmem.functional.pruning.sparse_format import pack_sparse_tree, unpack_sparse_tree

__all__ = ["CODECS", "CheckpointCorruptError", "CompressedCheckpointIO", "written_by_CompressedCheckpointIO"]

CODECS = ("zstd", "lz4", "none")
MAGIC = b"LOWMEMCK"
# A file starts with a tiny pickle that a plain ``torch.load`` refuses, naming this plugin (weights_only=True:
# "Unsupported global ... compressed_checkpoint_io.written_by_CompressedCheckpointIO"; weights_only=False:
# the function below raises with what to do), then MAGIC and the header.
PREFIX = b"\x80\x02clightning_lowmem.plugins.compressed_checkpoint_io\nwritten_by_CompressedCheckpointIO\n)R."
_HEADER = struct.Struct("<8sB7sQI")  # magic, format version, codec name (padded), raw length, crc32 of raw bytes
_CHUNK_ENTRY = struct.Struct("<BQ")  # stored compressed (1) or raw (0), stored length
_COUNT = struct.Struct("<I")
_VERSION = 2  # 1: no prefix, one compressed stream; 2: prefix, chunks stored compressed or raw
_CHUNK_BYTES = 2**20
_SAMPLE_BYTES = 16 * 2**10  # x 4 spots spread over a chunk


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is truncated or damaged."""


def written_by_CompressedCheckpointIO(*_: Any) -> None:  # noqa: N802 - the name is the message
    """Called by a plain ``torch.load(weights_only=False)`` of a compressed file: say how to load it."""
    raise RuntimeError(
        "this file was written by lightning_lowmem's CompressedCheckpointIO (not a torch.save file): "
        "load it with `Trainer(plugins=[CompressedCheckpointIO()])` or "
        "`lightning_lowmem.plugins.CompressedCheckpointIO().load_checkpoint(path)`"
    )


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


def _compress(chunk: memoryview, codec: str, level: int) -> bytes:
    if codec == "zstd":
        return _codec_module("zstd").ZstdCompressor(level=level).compress(chunk)
    return _codec_module("lz4").compress(chunk, compression_level=level)


def _decompress_chunk(payload: memoryview, codec: str, raw_length: int) -> bytes:
    if codec == "zstd":
        return _codec_module("zstd").ZstdDecompressor().decompress(payload, max_output_size=raw_length)
    return _codec_module("lz4").decompress(payload)


def _pack_chunks(raw: memoryview, codec: str, level: int, min_saving: float) -> list[tuple[bool, Any]]:
    """Each chunk of ``raw`` as ``(compressed, bytes)``: compressed only where that saves ``min_saving`` of it.

    Four 16 KiB samples spread over the chunk decide first, so chunks of random float mantissas (dense
    weights) cost no full compression attempt.
    """
    stored: list[tuple[bool, Any]] = []
    for chunk in _chunks(raw):
        if codec == "none":
            stored.append((False, chunk))
            continue
        if len(chunk) > 8 * _SAMPLE_BYTES:
            step = len(chunk) // 4
            samples = [chunk[i * step : i * step + _SAMPLE_BYTES] for i in range(4)]
            if sum(len(_compress(sample, codec, level)) for sample in samples) > (1 - min_saving) * 4 * _SAMPLE_BYTES:
                stored.append((False, chunk))
                continue
        packed = _compress(chunk, codec, level)
        stored.append((True, packed) if len(packed) <= (1 - min_saving) * len(chunk) else (False, chunk))
    return stored


def _decompress_v1(payload: bytes, codec: str, raw_length: int) -> bytes:
    if codec == "none":
        return payload
    return _decompress_chunk(memoryview(payload), codec, raw_length)


class CompressedCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes smaller checkpoints and never leaves a half-written one.

    On save: tensors that are mostly zeros (pruned weights, their optimizer state) are stored as a bitmask
    plus their non-zero values (:mod:`lightning_lowmem.functional.pruning.sparse_format`); the ``torch.save`` bytes
    are cut in 1 MiB chunks, each compressed with zstd or lz4 where that saves at least ``min_saving`` of it
    (samples decide) and stored raw otherwise, so dense weights (random float mantissas, ~8% gain)
    cost no compression time. When nothing was packed and compression would not shrink the whole file by
    ``min_saving`` either, the plain ``torch.save`` file is written (it loads without this plugin): the file is
    never larger than ``TorchCheckpointIO``'s. The file
    is written to a temporary file in the same directory and renamed over the target (``os.replace`` is
    atomic), so a process killed mid-save (``kill -9``, OOM killer, preemption) leaves the previous
    checkpoint intact; ``fsync=True`` also survives power loss.

    A compressed file starts with a few bytes that a plain ``torch.load`` refuses with a message naming this
    plugin, then a header with the raw length and CRC-32: a truncated or damaged file raises
    :class:`CheckpointCorruptError` naming the file. Plain ``torch.save`` checkpoints load too (damaged ones
    raise the same error). Loading uses ``torch.load(weights_only=True)`` unless asked otherwise, and
    ``map_location="cpu"`` unless given one (a callable ``map_location``, as Lightning passes, cannot rebuild
    torchao's quantized tensors: the load is retried on CPU).

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
        _codec_module(codec)  # fail early with the install hint
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
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Pack, compress and atomically write ``checkpoint`` to ``path``.

        Raises:
            TypeError: ``storage_options`` was given (not supported).
        """
        if storage_options is not None:
            raise TypeError(f"`storage_options` is not supported by {type(self).__name__}, got {storage_options!r}")
        packed, num_sparse = pack_sparse_tree(checkpoint, self.min_sparsity, self.min_numel) if self.sparse else (checkpoint, 0)
        if type(get_filesystem(path)).__name__ != "LocalFileSystem":  # remote: serialize in memory, write once
            buffer = io.BytesIO()
            torch.save(packed, buffer)
            self._write(path, buffer.getbuffer(), num_sparse, plain_file=None)
            return
        # torch.save straight to a temporary file named so that torch names its archive after the target (as
        # TorchCheckpointIO's file): when compression gains nothing, that file is renamed into place as it is
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        plain_file = target.with_name(f"{target.stem}.tmp-{os.getpid()}")
        try:
            torch.save(packed, plain_file)
            self._write(path, memoryview(plain_file.read_bytes()), num_sparse, plain_file)
        finally:
            plain_file.unlink(missing_ok=True)

    def _write(self, path: _PATH, raw: memoryview, num_sparse: int, plain_file: Path | None) -> None:
        stored = _pack_chunks(raw, self.codec, self.level, self.min_saving)
        framed_bytes = len(PREFIX) + _HEADER.size + _COUNT.size + sum(_CHUNK_ENTRY.size + len(c) for _, c in stored)
        if num_sparse == 0 and framed_bytes > (1 - self.min_saving) * len(raw):  # too little gained: plain torch.save
            if plain_file is None:
                written = _atomic_write(path, [raw], self.fsync)
            else:
                if self.fsync:
                    with open(plain_file, "rb+") as handle:
                        os.fsync(handle.fileno())
                os.replace(plain_file, path)
                written = len(raw)
        else:
            written = _atomic_write(path, _file_pieces(raw, stored, self.codec), self.fsync)
        self.last_save_stats = {"raw_bytes": len(raw), "file_bytes": written, "sparse_tensors": num_sparse,
                                "chunks": len(stored), "chunks_compressed": sum(c for c, _ in stored)}  # fmt: skip

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a checkpoint written by this plugin or by ``torch.save``.

        Args:
            path: the file.
            map_location: as for ``torch.load``. Default: ``None`` (``"cpu"``, as Lightning's own loading).
            weights_only: as for ``torch.load``; ``None`` = this plugin's ``weights_only``. Default: ``None``.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            CheckpointCorruptError: the file is truncated or damaged (names the file and what is wrong).
        """
        weights_only = self.weights_only if weights_only is None else weights_only
        map_location = "cpu" if map_location is None else map_location
        fs = get_filesystem(path)
        if not fs.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        with fs.open(path, "rb") as handle:
            start = handle.read(len(PREFIX) + len(MAGIC))
            ours = start.startswith(MAGIC) or (start and (PREFIX + MAGIC).startswith(start[:32]))  # even if cut short
            if not ours:  # a plain torch.save file
                handle.seek(0)
                return _finish(_torch_load(handle, path, map_location, weights_only), map_location)
            handle.seek(0)
            data = handle.read()
        raw = _read_v1(data, path) if data.startswith(MAGIC) else _read_v2(data, path)
        del data
        return _finish(_torch_load(io.BytesIO(raw), path, map_location, weights_only), map_location)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)


def _file_pieces(raw: memoryview, stored: list[tuple[bool, Any]], codec: str) -> Iterator[Any]:
    """The pieces of a version-2 file: prefix, header, chunk table, chunks."""
    yield PREFIX + _HEADER.pack(MAGIC, _VERSION, codec.encode().ljust(7, b"\0"), len(raw), zlib.crc32(raw))
    yield _COUNT.pack(len(stored)) + b"".join(_CHUNK_ENTRY.pack(int(compressed), len(c)) for compressed, c in stored)
    for _, chunk in stored:
        yield chunk


def _corrupt(path: _PATH, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {str(path)!r} is truncated or damaged: {what}. Delete it or load an earlier checkpoint."
    )


def _parse_header(data: bytes, offset: int, path: _PATH) -> tuple[int, str, int, int]:
    if len(data) < offset + _HEADER.size:
        raise _corrupt(path, f"{len(data)} bytes, shorter than its header")
    _, version, codec_name, raw_length, crc = _HEADER.unpack_from(data, offset)
    codec = codec_name.rstrip(b"\0").decode(errors="replace")
    if version not in (1, _VERSION) or codec not in CODECS:
        raise CheckpointCorruptError(
            f"checkpoint {str(path)!r} has an unknown format (version {version}, codec {codec!r}); "
            f"this lightning_lowmem reads versions 1-{_VERSION} with codecs {list(CODECS)}"
        )
    return version, codec, raw_length, crc


def _check_crc(raw: bytes, raw_length: int, crc: int, path: _PATH) -> bytes:
    if len(raw) != raw_length or zlib.crc32(raw) != crc:
        raise _corrupt(
            path, f"expected {raw_length} bytes with CRC-32 {crc:#010x}, got {len(raw)} bytes with CRC-32 {zlib.crc32(raw):#010x}"
        )
    return raw


def _read_v1(data: bytes, path: _PATH) -> bytes:
    _, codec, raw_length, crc = _parse_header(data, 0, path)
    try:
        raw = _decompress_v1(data[_HEADER.size :], codec, raw_length)
    except Exception as err:  # each codec raises its own error type on damaged input
        raise _corrupt(path, f"{codec} could not decompress it ({type(err).__name__}: {err}); the file has {len(data)} bytes") from err
    return _check_crc(raw, raw_length, crc, path)


def _read_v2(data: bytes, path: _PATH) -> bytes:
    offset = len(PREFIX)
    if not data.startswith(PREFIX + MAGIC):
        raise _corrupt(path, f"{len(data)} bytes, shorter than its header")
    _, codec, raw_length, crc = _parse_header(data, offset, path)
    offset += _HEADER.size
    if len(data) < offset + _COUNT.size:
        raise _corrupt(path, f"{len(data)} bytes, shorter than its chunk table")
    (count,) = _COUNT.unpack_from(data, offset)
    offset += _COUNT.size
    if len(data) < offset + count * _CHUNK_ENTRY.size:
        raise _corrupt(path, f"{len(data)} bytes, shorter than its table of {count} chunks")
    entries = [_CHUNK_ENTRY.unpack_from(data, offset + i * _CHUNK_ENTRY.size) for i in range(count)]
    offset += count * _CHUNK_ENTRY.size
    if offset + sum(length for _, length in entries) != len(data):
        raise _corrupt(path, f"{len(data)} bytes, its chunk table says {offset + sum(length for _, length in entries)}")
    view = memoryview(data)
    raw = bytearray()
    for index, (compressed, length) in enumerate(entries):
        piece = view[offset : offset + length]
        offset += length
        if compressed:
            try:
                piece = _decompress_chunk(piece, codec, _CHUNK_BYTES)
            except Exception as err:  # each codec raises its own error type on damaged input
                raise _corrupt(path, f"{codec} could not decompress chunk {index} ({type(err).__name__}: {err})") from err
        raw += piece
    return _check_crc(raw, raw_length, crc, path)


def _torch_load(source: Any, path: _PATH, map_location: Any, weights_only: bool) -> Any:
    try:
        return torch.load(source, map_location=map_location, weights_only=weights_only)
    except Exception as err:
        message = str(err)
        if "Callable map_location not supported" in message:  # torchao tensor subclasses: rebuild on CPU
            source.seek(0)
            return torch.load(source, map_location="cpu", weights_only=weights_only)
        if "weights_only" in message or "Weights only" in message or isinstance(err, (MemoryError, KeyboardInterrupt)):
            raise
        first_line = message.splitlines()[0] if message else ""
        raise _corrupt(path, f"torch.load failed ({type(err).__name__}: {first_line})") from err


def _finish(checkpoint: Any, map_location: Any) -> Any:
    """Rebuild packed sparse tensors, on ``map_location`` when it names one device."""
    checkpoint = unpack_sparse_tree(checkpoint)
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
        return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(map_location))
    return checkpoint


def _atomic_write(path: _PATH, pieces: Iterable[Any], fsync: bool = False) -> int:
    """Write ``pieces`` to a temporary file next to ``path`` and rename it over ``path``.

    Returns:
        Bytes written. On any error the temporary file is removed and ``path`` is untouched.
    """
    fs = get_filesystem(path)
    if type(fs).__name__ != "LocalFileSystem":  # remote stores have no rename-over; write in one go
        payload = b"".join(bytes(piece) for piece in pieces)
        with fs.open(str(path), "wb") as handle:
            handle.write(payload)
        return len(payload)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f"{target.stem}.tmp-{os.getpid()}.framed")
    written = 0
    try:
        with open(temporary, "wb") as handle:
            for piece in pieces:
                handle.write(piece)
                written += len(piece)
            if fsync:
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

