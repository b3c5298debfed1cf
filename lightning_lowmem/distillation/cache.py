"""Cached teacher outputs: run the teacher once over the training set, then train without it.

Files written for a cache at ``path`` (e.g. ``teacher_cache.npy``):

* ``path`` — a ``.npy`` array of teacher logits, row ``i`` for dataset sample ``i``: ``(N, *out)`` in
  full mode, or ``(N, *out[:-1], k)`` top-k values in top-k mode (read through ``np.load(mmap_mode="r")``,
  so only the rows of a batch are ever in memory);
* ``path + ".indices.npy"`` — the top-k class indices (top-k mode only);
* ``path + ".json"`` — metadata: sample count, dataset fingerprint, shapes, ``top_k``, teacher accuracy.

Batches find their rows by a hash of each sample's input bytes (from one CPU copy of the batch inputs),
so shuffling, samplers and DDP need no change to the data pipeline. A cache whose
sample count or fingerprint differs from the dataset is refused with :class:`StaleCacheError`.

Samples are ``(input, target, ...)`` tuples (the key hashes the input), bare tensors, or dicts such as
Hugging Face samples ``{"input_ids", "attention_mask", "labels"}`` (the key hashes every tensor of the
sample). Every sample must have the same shapes: pad in the dataset (as ``HFTextDataModule`` does), not in a
``collate_fn`` that pads each batch to its longest row, since the rows of such a batch no longer hash to
their samples. Padding itself is not a problem: the cache stores the logits of every position and the
training step masks padded positions out of the loss from the batch's own ``attention_mask`` / ``labels``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import default_collate

from lightning_lowmem.model_io import batch_size, describe_batch, forward_batch, output_logits

__all__ = [
    "StaleCacheError",
    "TeacherCache",
    "build_teacher_cache",
    "check_cache_arguments",
    "dataset_fingerprint",
    "sample_key",
]

CACHE_VERSION = 1


def check_cache_arguments(top_k: int | None, dtype: str, prefix: str = "") -> None:
    """Raise ``ValueError`` for a ``top_k`` that is not a positive int or ``None``, or a ``dtype`` other than
    ``"float16"`` / ``"float32"`` (``prefix`` names the arguments as the caller does, e.g. ``"cache_"``)."""
    if dtype not in ("float16", "float32"):
        raise ValueError(f"`{prefix}dtype`={dtype!r} is not supported; choose 'float16' or 'float32'")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0):
        raise ValueError(f"`{prefix}top_k` must be a positive int or None, got {top_k}")


class StaleCacheError(ValueError):
    """The cache on disk was built for another dataset (size or content differ)."""


def _update(digest: Any, tensor: torch.Tensor) -> None:
    array = tensor.detach().cpu().contiguous().numpy()
    digest.update(f"{array.dtype}{array.shape}".encode())
    digest.update(array.tobytes())


def sample_key(sample: torch.Tensor | Mapping[str, torch.Tensor]) -> bytes:
    """A 16-byte hash of one sample's dtype, shape and bytes (of each tensor, by key, for a dict sample)."""
    digest = hashlib.blake2b(digest_size=16)
    if isinstance(sample, Mapping):
        for key in sorted(sample):
            if isinstance(sample[key], torch.Tensor):
                digest.update(str(key).encode())
                _update(digest, sample[key])
    else:
        _update(digest, sample)
    return digest.digest()


def batch_keys(batch: Any) -> list[bytes]:
    """:func:`sample_key` of every row of a batch: a tensor ``(B, ...)``, an ``(inputs, targets)`` tuple (the
    inputs are hashed) or a dict batch (each row's tensors are hashed)."""
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    if isinstance(batch, Mapping):
        tensors = {k: v.detach().cpu() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        rows = batch_size(tensors) or 0
        return [sample_key({k: v[i] for k, v in tensors.items()}) for i in range(rows)]
    return [sample_key(row) for row in batch.detach().cpu()]


def _input_of(item: Any) -> torch.Tensor | Mapping[str, torch.Tensor]:
    sample = item[0] if isinstance(item, (tuple, list)) else item
    if not isinstance(sample, (torch.Tensor, Mapping)):
        raise TypeError(
            f"teacher cache needs dataset items that are tensors, (input, ...) tuples or dicts of tensors; got "
            f"{type(sample).__name__}"
        )
    return sample


def dataset_fingerprint(dataset: Sequence[Any]) -> tuple[list[bytes], str]:
    """Per-sample keys and a fingerprint of the whole dataset (hash of the keys in order)."""
    keys = [sample_key(_input_of(dataset[i])) for i in range(len(dataset))]
    digest = hashlib.sha256()
    for key in keys:
        digest.update(key)
    return keys, digest.hexdigest()[:32]


def _to(batch: Any, device: torch.device | str) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return [_to(v, device) for v in batch]
    return batch


def _paths(path: str | Path) -> tuple[Path, Path, Path]:
    values = Path(path)
    return values, Path(f"{values}.indices.npy"), Path(f"{values}.json")


class TeacherCache:
    """Teacher logits on disk, looked up by sample key. Build with :func:`build_teacher_cache`; open with
    :meth:`load`.

    Attributes:
        path: the ``.npy`` values file.
        meta: the metadata dict (see module docstring).
    """

    def __init__(self, path: Path, meta: dict[str, Any], keys: list[bytes]) -> None:
        self.path = path
        self.meta = meta
        values_path, indices_path, _ = _paths(path)
        self._values = np.load(values_path, mmap_mode="r")
        self._indices = np.load(indices_path, mmap_mode="r") if meta["top_k"] else None
        self._rows = {key: row for row, key in enumerate(keys)}  # duplicates: any row holds the same output

    @classmethod
    def load(cls, path: str | Path, dataset: Sequence[Any]) -> TeacherCache:
        """Open the cache at ``path`` after checking it was built for ``dataset``.

        Raises:
            FileNotFoundError: no cache at ``path``.
            StaleCacheError: different sample count or fingerprint (delete the files to rebuild).
        """
        values_path, _, meta_path = _paths(path)
        if not values_path.exists() or not meta_path.exists():
            raise FileNotFoundError(f"no teacher cache at {str(values_path)!r} (and {str(meta_path)!r})")
        meta = json.loads(meta_path.read_text())
        hint = f"delete {str(values_path)!r} and its .json / .indices.npy files to rebuild it"
        if meta.get("version") != CACHE_VERSION:
            raise StaleCacheError(
                f"teacher cache {str(values_path)!r} has version {meta.get('version')}, expected {CACHE_VERSION}; {hint}"
            )
        if meta["num_samples"] != len(dataset):
            raise StaleCacheError(
                f"stale teacher cache {str(values_path)!r}: built for {meta['num_samples']} samples, the training "
                f"set has {len(dataset)}; {hint}"
            )
        keys, fingerprint = dataset_fingerprint(dataset)
        if meta["fingerprint"] != fingerprint:
            raise StaleCacheError(
                f"stale teacher cache {str(values_path)!r}: dataset fingerprint {fingerprint} differs from the "
                f"cached {meta['fingerprint']} (same size, different samples); {hint}"
            )
        return cls(values_path, meta, keys)

    @property
    def num_classes(self) -> int:
        return int(self.meta["output_shape"][-1])

    def rows(self, keys: list[bytes]) -> list[int]:
        """Dataset rows of the given sample keys.

        Raises:
            KeyError: a sample is not in the cached dataset (e.g. random augmentation changed it, or a
                ``collate_fn`` padded the batch).
        """
        try:
            return [self._rows[key] for key in keys]
        except KeyError:
            raise KeyError(
                "a training sample is not in the teacher cache: inputs must be the exact cached samples "
                "(random augmentation cannot be cached, and a collate_fn that pads or masks each batch changes "
                "the rows; pad in the dataset, or train with the live teacher instead)"
            ) from None

    def logits(
        self, rows: list[int], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Teacher logits of ``rows`` as ``(B, *output_shape)``.

        In top-k mode the classes outside the top-k get ``-inf``: the softmax is the teacher's
        distribution renormalised over its top-k classes.
        """
        order = np.asarray(rows, dtype=np.int64)
        values = torch.from_numpy(np.ascontiguousarray(self._values[order])).to(device=device, dtype=dtype)
        if self._indices is None:
            return values  # (B, *out)
        indices = torch.from_numpy(np.ascontiguousarray(self._indices[order])).to(device=device, dtype=torch.long)
        dense = torch.full((*values.shape[:-1], self.num_classes), float("-inf"), device=device, dtype=dtype)
        return dense.scatter_(-1, indices, values)  # (B, *out[:-1], C)


@torch.no_grad()
def build_teacher_cache(
    teacher: nn.Module | Callable[[Any], torch.Tensor],
    dataset: Sequence[Any],
    path: str | Path,
    top_k: int | None = None,
    batch_size: int = 256,
    dtype: str = "float16",
    device: torch.device | str = "cpu",
) -> TeacherCache:
    """Run ``teacher`` over ``dataset`` once and write its logits to ``path``.

    Args:
        teacher: the teacher, already in eval mode on ``device``: an ``nn.Module`` is called on each batch the
            way :func:`lightning_lowmem.model_io.forward_batch` does (a dict batch as keywords, a tuple's first
            element) and its logits read with ``output_logits``; any other callable receives the batch of
            samples collated as a ``DataLoader`` would and returns the logits.
        dataset: indexable dataset whose items are tensors, ``(input, target, ...)`` tuples or dicts of
            tensors (Hugging Face samples), all of one shape.
        path: the ``.npy`` file to write (parents are created).
        top_k: keep only the ``k`` largest logits per position. Default: ``None`` (all).
        batch_size: samples per teacher call. Default: 256.
        dtype: on-disk dtype, ``"float16"`` or ``"float32"``. Default: ``"float16"``.
        device: where the teacher runs. Default: ``"cpu"``.

    Returns:
        The opened :class:`TeacherCache`; ``meta["teacher_accuracy"]`` is set when the items carry
        integer targets.

    Raises:
        ValueError: bad ``top_k`` / ``dtype`` / ``batch_size``, an empty dataset, or samples of different shapes.
    """
    check_cache_arguments(top_k, dtype)
    if batch_size <= 0:
        raise ValueError(f"`batch_size` must be > 0, got {batch_size}")
    if len(dataset) == 0:
        raise ValueError("cannot build a teacher cache from an empty dataset")
    values_path, indices_path, meta_path = _paths(path)
    values_path.parent.mkdir(parents=True, exist_ok=True)
    keys, fingerprint = dataset_fingerprint(dataset)
    values_file = indices_file = None
    correct = counted = 0
    output_shape: list[int] = []
    first = describe_batch(_input_of(dataset[0]))
    for start in range(0, len(dataset), batch_size):
        items = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        for offset, item in enumerate(items):
            if describe_batch(_input_of(item)) != first:
                raise ValueError(
                    f"teacher cache needs samples of one shape: sample 0 is {first}, sample {start + offset} is "
                    f"{describe_batch(_input_of(item))}; pad every sample to one length in the dataset, or train "
                    "with the live teacher (no `teacher_cache`)"
                )
        batch = _to(default_collate(items), device)
        if isinstance(teacher, nn.Module):
            logits = output_logits(forward_batch(teacher, batch)).float()  # (b, *out)
        else:
            logits = teacher(batch).float()
        if values_file is None:
            output_shape = list(logits.shape[1:])
            if top_k is not None and top_k > output_shape[-1]:
                raise ValueError(f"`top_k`={top_k} exceeds the teacher's {output_shape[-1]} classes")
            stored = output_shape[:-1] + [top_k or output_shape[-1]]
            values_file = np.lib.format.open_memmap(values_path, mode="w+", dtype=dtype, shape=(len(dataset), *stored))
            if top_k:
                indices_file = np.lib.format.open_memmap(
                    indices_path, mode="w+", dtype=np.int32, shape=(len(dataset), *stored)
                )
        if isinstance(items[0], (tuple, list)) and len(items[0]) > 1 and isinstance(items[0][1], torch.Tensor):
            targets = batch[1].to(logits.device)
            if not targets.is_floating_point() and targets.shape == logits.shape[:-1]:
                correct += int((logits.argmax(-1) == targets).sum())
                counted += targets.numel()
        end = start + len(items)
        if top_k:
            top_values, top_indices = logits.topk(top_k, dim=-1)
            values_file[start:end] = top_values.cpu().numpy()
            indices_file[start:end] = top_indices.cpu().numpy()
        else:
            values_file[start:end] = logits.cpu().numpy()
    assert values_file is not None
    values_file.flush()
    if indices_file is not None:
        indices_file.flush()
    del values_file, indices_file
    meta = {
        "version": CACHE_VERSION,
        "num_samples": len(dataset),
        "fingerprint": fingerprint,
        "output_shape": output_shape,
        "top_k": top_k,
        "dtype": dtype,
        "teacher_accuracy": correct / counted if counted else None,
    }
    meta_path.write_text(json.dumps(meta, indent=2))
    return TeacherCache(values_path, meta, keys)
