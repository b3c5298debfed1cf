"""The Hugging Face model zoo of the tests: tiny randomly initialised GPT-2, Llama, BERT and T5 (no downloads).

Each family is wrapped the way users wrap it (:class:`lightning_lowmem.demo.HFLanguageModel`: dict batches,
``self.model(**batch).loss``) and fed by :class:`lightning_lowmem.demo.HFTextDataModule` (ragged rows, attention
masks, ``-100`` labels on padding). Tests take the ``hf_family`` fixture (parametrised over :data:`FAMILIES`)
or call :func:`hf_module` / :func:`hf_data` / :func:`hf_batch` directly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from lightning_lowmem.demo.hf import FAMILIES, HFLanguageModel, HFTextDataModule  # noqa: E402

__all__ = ["FAMILIES", "hf_batch", "hf_data", "hf_module"]


def hf_module(family: str, seed: int = 0, **config: Any) -> HFLanguageModel:
    """A tiny ``family`` model in its LightningModule wrapper, seeded."""
    torch.manual_seed(seed)
    return HFLanguageModel(family, config=config or None)


def hf_data(family: str, seq_len: int = 32, batch_size: int = 4, **kwargs: Any) -> HFTextDataModule:
    """Dict batches for ``family``'s task (causal / masked / seq2seq) from 60 kB of the stdlib corpus."""
    kwargs.setdefault("max_chars", 60_000)
    return HFTextDataModule(FAMILIES[family], seq_len=seq_len, batch_size=batch_size, **kwargs)


def hf_batch(family: str, seq_len: int = 32, batch_size: int = 4) -> dict[str, torch.Tensor]:
    """The first training batch of :func:`hf_data`."""
    data = hf_data(family, seq_len=seq_len, batch_size=batch_size)
    data.setup("fit")
    return next(iter(torch.utils.data.DataLoader(data.train_set, batch_size=batch_size)))
