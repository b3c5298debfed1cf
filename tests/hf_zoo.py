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

from lightning_lowmem.models.hf import FAMILIES, HFLanguageModel, HFTextDataModule  # noqa: E402

__all__ = ["FAMILIES", "constant_bytes", "hf_batch", "hf_data", "hf_module", "size_ratio", "t5_tied_names"]


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


def constant_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s non-persistent buffers: constants the model rebuilds, never saved, quantized or pruned.

    transformers 4.x GPT-2 keeps a ``(1, 1, n_positions, n_positions)`` causal mask per block (64 KiB each in
    the zoo's tiny model: a third of its int8 size), 5.x none. Size ratios leave them out of both sides
    (:func:`size_ratio`), so a test measures what a technique does to the weights on either version.
    """
    saved = set(module.state_dict())
    return sum(buffer.untyped_storage().nbytes() for name, buffer in module.named_buffers() if name not in saved)


def size_ratio(before: int, after: int, module: torch.nn.Module) -> float:
    """``before / after`` (bytes of ``module``, e.g. a quantization report's) without its :func:`constant_bytes`."""
    constant = constant_bytes(module)
    return (before - constant) / (after - constant)


T5_TABLES = ["model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens", "model.lm_head"]
"""Every name under which T5's one token table is used (the four-way tie)."""


def t5_tied_names() -> list[str]:
    """T5's tied group as ``tied_groups`` names it (one name per module, in module order).

    On transformers 5 each stack owns an Embedding sharing the table's weight: four modules, four names. On 4.x
    the stacks hold ``model.shared`` itself, one module reachable under three names, which counts once:
    ``["model.shared", "model.lm_head"]``. The weight is one tensor either way (check it over :data:`T5_TABLES`).
    """
    model = hf_module("t5").model
    if model.encoder.embed_tokens is model.shared:
        return ["model.shared", "model.lm_head"]
    return list(T5_TABLES)
