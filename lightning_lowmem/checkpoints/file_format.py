"""The compressed checkpoint file: ``torch.save`` bytes cut in 1 MiB chunks, each stored compressed or raw.

Layout of a version-2 file::

    PREFIX                     a tiny pickle that a plain torch.load refuses, naming CompressedCheckpointIO
    header                     MAGIC, format version, codec name, raw length, CRC-32 of the raw bytes
    chunk table                count, then per chunk: stored compressed (1) or raw (0), stored length
    chunks

Version 1 (no prefix, one compressed stream) is still read. A chunk is stored compressed only where that
saves ``min_saving`` of it; four 16 KiB samples decide first, so chunks of random float mantissas (dense
weights) cost no full compression attempt. Before any of that, :func:`samples_say_plain` compresses a few
4 KiB samples of each tensor: when even the best case saves less than ``min_saving``, the plain ``torch.save``
file is written straight to disk (no in-memory copy, no chunking). Nothing here imports Lightning.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "CODECS",
    "MAGIC",
    "PREFIX",
    "CheckpointCorruptError",
    "atomic_save",
    "atomic_write",
    "codec_module",
    "corrupt",
    "framed_pieces",
    "framed_size",
    "is_framed",
    "pack_chunks",
    "read_framed",
    "register_prefix_safe_global",
    "samples_say_plain",
    "written_by_CompressedCheckpointIO",
]

CODECS = ("zstd", "lz4", "none")
MAGIC = b"LOWMEMCK"
# A plain ``torch.load`` of a framed file refuses its first pickle, naming the plugin (weights_only=True:
# "Unsupported global ... compressed_checkpoint_io.written_by_CompressedCheckpointIO"; weights_only=False: the
# function below raises with what to do). The path is the plugin's public module, which re-exports that function.
PREFIX = b"\x80\x02clightning_lowmem.plugins.compressed_checkpoint_io\nwritten_by_CompressedCheckpointIO\n)R."
_HEADER = struct.Struct("<8sB7sQI")  # magic, format version, codec name (padded), raw length, crc32 of raw bytes
_CHUNK_ENTRY = struct.Struct("<BQ")  # stored compressed (1) or raw (0), stored length
_COUNT = struct.Struct("<I")
VERSION = 2  # 1: no prefix, one compressed stream; 2: prefix, chunks stored compressed or raw
CHUNK_BYTES = 2**20
_SAMPLE_BYTES = 16 * 2**10  # x 4 spots spread over a chunk
_TENSOR_SAMPLE_BYTES = 4 * 2**10  # one per 256 KiB of each tensor (samples_say_plain)


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is truncated or damaged."""


def written_by_CompressedCheckpointIO(*_: Any) -> None:  # the name is the message
    """Called by a plain ``torch.load(weights_only=False)`` of a compressed file: say how to load it."""
    raise RuntimeError(
        "this file was written by lightning_lowmem's CompressedCheckpointIO (not a torch.save file): "
        "load it with `Trainer(plugins=[CompressedCheckpointIO()])` or "
        "`lightning_lowmem.checkpoints.read_checkpoint(path)`"
    )


PREFIX_GLOBAL = "lightning_lowmem.plugins.compressed_checkpoint_io.written_by_CompressedCheckpointIO"
"""The global :data:`PREFIX` names (the plugin's public module re-exports the function)."""


def register_prefix_safe_global() -> None:
    """Allowlist :func:`written_by_CompressedCheckpointIO` under :data:`PREFIX_GLOBAL` for
    ``torch.load(weights_only=True)`` (idempotent; ``import lightning_lowmem`` does it once torch is loaded), so
    that a plain ``torch.load`` of a compressed file raises its one-line message. Calling it only raises: the
    allowlist lets no data through. Registered by name, so Lightning (the plugin's module) is not imported."""
    import torch

    if PREFIX_GLOBAL not in {name for _, name in _named_safe_globals(torch.serialization.get_safe_globals())}:
        torch.serialization.add_safe_globals([(written_by_CompressedCheckpointIO, PREFIX_GLOBAL)])


def _named_safe_globals(entries: Iterable[Any]) -> Iterable[tuple[Any, str]]:
    return (entry for entry in entries if isinstance(entry, tuple))


def codec_module(codec: str) -> Any:
    """The compression module of ``codec`` (``None`` for ``"none"``).

    Raises:
        ImportError: its package is missing (with the install command).
    """
    from lightning_lowmem._versions import optional_import

    feature = f"CompressedCheckpointIO(codec={codec!r})"
    if codec == "zstd":
        return optional_import("zstandard", feature, extra="compress")
    if codec == "lz4":
        return optional_import("lz4.frame", feature, extra="compress", distribution="lz4")
    return None


def _compressor(codec: str, level: int) -> Any:
    """``compress(bytes) -> bytes`` for ``codec``; one zstd context for all calls (creating one costs more than
    compressing a 16 KiB sample)."""
    if codec == "zstd":
        return codec_module("zstd").ZstdCompressor(level=level).compress
    lz4 = codec_module("lz4")
    return lambda chunk: lz4.compress(chunk, compression_level=level)


def _decompressor(codec: str) -> Any:
    """``decompress(payload, max_length) -> bytes`` for ``codec``; one zstd context for all chunks of a file."""
    if codec == "none":
        return lambda payload, max_length: bytes(payload)
    if codec == "zstd":
        context = codec_module("zstd").ZstdDecompressor()
        return lambda payload, max_length: context.decompress(payload, max_output_size=max_length)
    lz4 = codec_module("lz4")
    return lambda payload, max_length: lz4.decompress(payload)


def pack_chunks(raw: memoryview, codec: str, level: int, min_saving: float) -> list[tuple[bool, Any]]:
    """Each 1 MiB chunk of ``raw`` as ``(compressed, bytes)``: compressed only where that saves ``min_saving``.

    Example::

        >>> stored = pack_chunks(memoryview(bytes(3 * 2**20)), "zstd", 3, 0.1)  # zeros compress
        >>> [(compressed, len(chunk) < 2**20) for compressed, chunk in stored]
        [(True, True), (True, True), (True, True)]
    """
    stored: list[tuple[bool, Any]] = []
    compress = _compressor(codec, level) if codec != "none" else None
    for start in range(0, len(raw), CHUNK_BYTES):
        chunk = raw[start : start + CHUNK_BYTES]
        if compress is None:
            stored.append((False, chunk))
            continue
        if len(chunk) > 8 * _SAMPLE_BYTES:
            step = len(chunk) // 4  # a sample in the middle of each quarter: not biased to a chunk's first bytes
            samples = [chunk[i * step + (step - _SAMPLE_BYTES) // 2 :][:_SAMPLE_BYTES] for i in range(4)]
            if sum(len(compress(sample)) for sample in samples) > (1 - min_saving) * 4 * _SAMPLE_BYTES:
                stored.append((False, chunk))
                continue
        packed = compress(chunk)
        stored.append((True, packed) if len(packed) <= (1 - min_saving) * len(chunk) else (False, chunk))
    return stored


def samples_say_plain(tensors: Iterable[Any], codec: str, level: int, min_saving: float) -> bool:
    """True when compressing the bytes of the tensors among ``tensors`` cannot save ``min_saving`` of them, judged
    from samples (other values are skipped).

    Each storage gives one 4 KiB sample per 256 KiB (at least one, spread over it; a storage met twice counts
    once), and all samples are compressed in one call; a storage under 4 KiB counts as compressing to nothing (the
    best case). The bound is optimistic, so ``False`` only means "maybe": the chunked path then decides exactly. A
    tensor whose bytes are not a plain storage (a subclass, a sparse layout, meta) gives ``False``. Costs about 2%
    of compressing everything.

    Example::

        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> dense, zeros = [torch.randn(512, 512)], [torch.zeros(512, 512)]
        >>> samples_say_plain(dense, "zstd", 3, 0.1), samples_say_plain(zeros, "zstd", 3, 0.1)
        (True, False)
    """
    import torch

    if codec == "none":
        return True
    seen: set[tuple[int, str]] = set()
    samples, sampled_bytes, tiny_bytes = [], 0, 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue  # the pickle's other values: a few bytes
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
            return False
        if tensor.device.type == "meta":
            return False
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), str(storage.device))
        if key in seen:
            continue
        seen.add(key)
        nbytes = storage.nbytes()
        if nbytes < _TENSOR_SAMPLE_BYTES:
            tiny_bytes += nbytes
            continue
        sampled_bytes += nbytes
        count = max(1, nbytes // (64 * _TENSOR_SAMPLE_BYTES))
        step = nbytes // count
        data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        starts = [i * step + (step - _TENSOR_SAMPLE_BYTES) // 2 for i in range(count)]
        samples += [data[start : start + _TENSOR_SAMPLE_BYTES] for start in starts]
    total = sampled_bytes + tiny_bytes
    if not samples:
        return total == 0
    joined = torch.cat(samples).cpu().numpy()
    ratio = len(_compressor(codec, level)(memoryview(joined))) / len(joined)
    return sampled_bytes * max(0.0, 1 - ratio) + tiny_bytes < min_saving * total


def framed_pieces(raw: memoryview, stored: list[tuple[bool, Any]], codec: str) -> list[Any]:
    """The pieces of a version-2 file holding ``raw`` as ``stored``: prefix + header, chunk table, chunks."""
    header = PREFIX + _HEADER.pack(MAGIC, VERSION, codec.encode().ljust(7, b"\0"), len(raw), zlib.crc32(raw))
    table = _COUNT.pack(len(stored)) + b"".join(_CHUNK_ENTRY.pack(int(compressed), len(c)) for compressed, c in stored)
    return [header, table, *(chunk for _, chunk in stored)]


def framed_size(stored: list[tuple[bool, Any]]) -> int:
    """Bytes of the version-2 file holding ``stored``."""
    return len(PREFIX) + _HEADER.size + _COUNT.size + sum(_CHUNK_ENTRY.size + len(chunk) for _, chunk in stored)


def is_framed(start: bytes) -> bool:
    """True when a file beginning with ``start`` (its first ``len(PREFIX) + 8`` bytes) is a framed file, even
    one cut short (it then fails as corrupt rather than as a torch.save file)."""
    return start.startswith(MAGIC) or bool(start and (PREFIX + MAGIC).startswith(start[:32]))


def corrupt(path: Any, what: str) -> CheckpointCorruptError:
    """The error for a damaged file, naming it."""
    return CheckpointCorruptError(
        f"checkpoint {str(path)!r} is truncated or damaged: {what}. Delete it or load an earlier checkpoint."
    )


def _parse_header(data: bytes, offset: int, path: Any) -> tuple[int, str, int, int]:
    if len(data) < offset + _HEADER.size:
        raise corrupt(path, f"{len(data)} bytes, shorter than its header")
    _, version, codec_name, raw_length, crc = _HEADER.unpack_from(data, offset)
    codec = codec_name.rstrip(b"\0").decode(errors="replace")
    if version not in (1, VERSION) or codec not in CODECS:
        raise CheckpointCorruptError(
            f"checkpoint {str(path)!r} has an unknown format (version {version}, codec {codec!r}); "
            f"this lightning_lowmem reads versions 1-{VERSION} with codecs {list(CODECS)}"
        )
    return version, codec, raw_length, crc


def _check_crc(raw: bytes, raw_length: int, crc: int, path: Any) -> bytes:
    if len(raw) != raw_length or zlib.crc32(raw) != crc:
        raise corrupt(
            path,
            f"expected {raw_length} bytes with CRC-32 {crc:#010x}, got {len(raw)} bytes with CRC-32 {zlib.crc32(raw):#010x}",
        )
    return raw


def read_framed(data: bytes, path: Any) -> bytes:
    """The ``torch.save`` bytes held by a framed file's ``data`` (version 1 or 2), CRC-checked.

    Raises:
        CheckpointCorruptError: truncated or damaged (names ``path`` and what is wrong), or an unknown version.
    """
    if data.startswith(MAGIC):  # version 1: header, then one compressed stream
        _, codec, raw_length, crc = _parse_header(data, 0, path)
        try:
            raw = _decompressor(codec)(memoryview(data)[_HEADER.size :], raw_length)
        except Exception as err:  # each codec raises its own error type on damaged input
            raise corrupt(
                path, f"{codec} could not decompress it ({type(err).__name__}: {err}); the file has {len(data)} bytes"
            ) from err
        return _check_crc(raw, raw_length, crc, path)
    offset = len(PREFIX)
    if not data.startswith(PREFIX + MAGIC):
        raise corrupt(path, f"{len(data)} bytes, shorter than its header")
    _, codec, raw_length, crc = _parse_header(data, offset, path)
    offset += _HEADER.size
    if len(data) < offset + _COUNT.size:
        raise corrupt(path, f"{len(data)} bytes, shorter than its chunk table")
    (count,) = _COUNT.unpack_from(data, offset)
    offset += _COUNT.size
    if len(data) < offset + count * _CHUNK_ENTRY.size:
        raise corrupt(path, f"{len(data)} bytes, shorter than its table of {count} chunks")
    entries = [_CHUNK_ENTRY.unpack_from(data, offset + i * _CHUNK_ENTRY.size) for i in range(count)]
    offset += count * _CHUNK_ENTRY.size
    if offset + sum(length for _, length in entries) != len(data):
        raise corrupt(path, f"{len(data)} bytes, its chunk table says {offset + sum(length for _, length in entries)}")
    view = memoryview(data)
    decompress = _decompressor(codec)
    raw = bytearray()
    for index, (compressed, length) in enumerate(entries):
        piece = view[offset : offset + length]
        offset += length
        if compressed:
            try:
                piece = decompress(piece, CHUNK_BYTES)
            except Exception as err:  # each codec raises its own error type on damaged input
                raise corrupt(
                    path, f"{codec} could not decompress chunk {index} ({type(err).__name__}: {err})"
                ) from err
        raw += piece
    return _check_crc(raw, raw_length, crc, path)


def atomic_write(path: Any, pieces: Iterable[Any], fsync: bool = False) -> int:
    """Write ``pieces`` to a temporary file next to local ``path`` and rename it over ``path``
    (``os.replace`` is atomic: a process killed mid-write leaves the previous file intact).

    Returns:
        Bytes written. On any error the temporary file is removed and ``path`` is untouched.
    """

    def write(handle: Any) -> None:
        for piece in pieces:
            handle.write(piece)

    return atomic_save(path, write, fsync)


def atomic_save(path: Any, write: Any, fsync: bool = False, size_hint: int = 0) -> int:
    """Call ``write(handle)`` on a temporary file next to local ``path`` (opened ``"wb"``) and rename it over
    ``path``, as :func:`atomic_write` does (``torch.save`` writes through the handle: the bytes are those it
    writes into a buffer, no copy held in memory).

    ``size_hint`` bytes are allocated first (``posix_fallocate``, Linux; cut to what was written afterwards): ext4
    flushes a file's not-yet-allocated pages, synchronously, when it is renamed over another (its
    ``auto_da_alloc`` guard against zero-length files), which made a rename-over save of 16 MiB take 1.4-2x
    ``torch.save``'s time; allocated blocks need no such flush.

    Returns:
        Bytes written. On any error the temporary file is removed and ``path`` is untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f"{target.stem}.tmp-{os.getpid()}.framed")
    try:
        with open(temporary, "wb") as handle:
            if size_hint > 0 and hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(handle.fileno(), 0, size_hint)
                except OSError:  # a filesystem without it: write as usual
                    pass
            write(handle)
            written = handle.tell()
            if size_hint > 0:
                handle.truncate(written)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return written
