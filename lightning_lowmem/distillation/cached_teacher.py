"""The cached-teacher mode of :class:`~lightning_lowmem.distillation.DistillationModule`: build the teacher-output
cache of the training set once (rank 0, at the start of the first fit), open it on every rank, release the teacher.

A mixin of the module (it reads the module's ``hparams``, its teacher and ``teacher_logits``), kept apart so the
module holds the training step and this file the cache's life cycle; the cache itself is
:mod:`lightning_lowmem.distillation.cache`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_lowmem.distillation.cache import TeacherCache, build_teacher_cache

__all__ = ["CachedTeacherMixin"]


class CachedTeacherMixin:
    """``prepare_teacher_cache`` and the ``on_train_start`` that calls it (``teacher_cache=`` given)."""

    hparams: Any
    trainer: Any
    device: torch.device
    _cache: TeacherCache | None
    _teacher_source_slot: list[Any]

    def _use_cache(self) -> bool:
        return self.hparams.teacher_cache is not None

    def prepare_teacher_cache(
        self, dataset: Any, device: torch.device | str = "cpu", build: bool = True
    ) -> TeacherCache:
        """Open the teacher cache for ``dataset`` (building it first if absent), then release the teacher.

        Raises:
            StaleCacheError: the cache on disk was built for another dataset.
            FileNotFoundError: no cache and ``build`` is False.
        """
        path = Path(self.hparams.teacher_cache)
        if not path.exists() and build:
            if not self._teacher_source_slot:
                raise ValueError(f"missing teacher: no cache at {str(path)!r} and no `teacher` to build it from")
            rank_zero_info(f"[DistillationModule] building the teacher cache {path} for {len(dataset)} samples")
            self.teacher.to(device)  # built from its source here
            hp = self.hparams
            build_teacher_cache(self.teacher_logits, dataset, path, hp.cache_top_k, dtype=hp.cache_dtype, device=device)
        self._cache = TeacherCache.load(path, dataset)
        self.release_teacher()
        return self._cache

    def on_train_start(self) -> None:
        if not self._use_cache() or self._cache is not None:
            return
        dataset = self.trainer.train_dataloader.dataset
        if self.trainer.is_global_zero:
            self.prepare_teacher_cache(dataset, device=self.device)
        self.trainer.strategy.barrier("teacher_cache")
        if not self.trainer.is_global_zero:
            self.prepare_teacher_cache(dataset, build=False)
        accuracy = self._cache.meta.get("teacher_accuracy") if self._cache else None
        if accuracy is not None:
            rank_zero_info(f"[DistillationModule] teacher accuracy on the cached training set: {accuracy:.4f}")
