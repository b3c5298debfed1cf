"""The embedded text corpus: the Python standard library's own ``.py`` sources, as bytes (no download).

The char-level GPT of ``demo/charlm.py`` and the Hugging Face wrappers of ``models/hf.py`` train on it.
"""

from __future__ import annotations

import fnmatch
import functools
import sysconfig
from pathlib import Path

import torch

__all__ = ["load_corpus", "stdlib_files"]


def stdlib_files(include: list[str] | None = None, exclude: list[str] | None = None) -> list[Path]:
    """Sorted ``.py`` files of the stdlib, relative patterns (fnmatch) to include / exclude.

    ``test/`` and ``site-packages`` are always excluded. Patterns match the path relative to the
    stdlib root, e.g. ``"email/*"`` or ``"json/*"``.
    """
    files = []
    for path, rel in _stdlib_sources():
        if include and not any(fnmatch.fnmatch(rel, pattern) for pattern in include):
            continue
        if exclude and any(fnmatch.fnmatch(rel, pattern) for pattern in exclude):
            continue
        files.append(path)
    return files


@functools.lru_cache(maxsize=1)
def _stdlib_sources() -> tuple[tuple[Path, str], ...]:
    """``(path, path relative to the stdlib root)`` of every stdlib ``.py`` file but tests, sorted.

    Walked once per process (a few tenths of a second: the walk passes through ``site-packages``); every
    data module of a run reads this list.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("test/", "site-packages/")) or "/test/" in rel or "/tests/" in rel or "idle_test" in rel:
            continue
        sources.append((path, rel))
    return tuple(sources)


def load_corpus(max_chars: int, include: list[str] | None = None, exclude: list[str] | None = None) -> torch.Tensor:
    """The corpus as a uint8 tensor of at most ``max_chars`` bytes (files in sorted order)."""
    files = stdlib_files(include, exclude)
    if not files:
        raise ValueError(f"no stdlib .py file matches include={include!r} exclude={exclude!r}")
    chunks, size = [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_chars:
            break
    blob = b"\n".join(chunks)[:max_chars]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)
