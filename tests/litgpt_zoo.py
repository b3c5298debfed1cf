"""The LitGPT model zoo of the tests: tiny randomly initialised LitGPT ``GPT`` models (no downloads).

LitGPT (Lightning's own LLM library) is an optional extra: litgpt 0.5.x pins huggingface-hub below what
transformers 5 needs, so it installs in the transformers-4 leg of ``make test-compat`` and the tests that import
this module are skipped elsewhere. Two families: ``"pythia"`` (GPT-NeoX: LayerNorm, parallel residual, biases,
``GptNeoxMLP``) and ``"llama"`` (RMSNorm, grouped-query attention, ``LLaMAMLP``, no biases), each shrunk to two
``Block`` s of width 64 and a vocabulary of 512. The wrapper trains as LitGPT's recipes do: ``logits =
model(idx)``, the loss on the shifted targets, written with :func:`chunked_cross_entropy` (the one-line change
of docs/llm_memory.md; on a plain logits tensor it is the ordinary cross-entropy).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

litgpt = pytest.importorskip("litgpt")

from lightning_lowmem.functional.cross_entropy import chunked_cross_entropy  # noqa: E402

__all__ = ["FAMILIES", "LINEARS", "LitGPTModule", "litgpt_batch", "litgpt_data"]

VOCAB = 512
SEQ_LEN = 32
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "pythia": ("pythia-14m", {}),
    "llama": ("Llama-3.2-1B", {"n_query_groups": 2, "intermediate_size": 128}),
}
"""Family -> (LitGPT config name, overrides beyond the shared shrink)."""

LINEARS = {
    "pythia": ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"],
    "llama": ["attn.qkv", "attn.proj", "mlp.fc_1", "mlp.fc_2", "mlp.proj"],
}
"""The ``nn.Linear`` layers of one LitGPT ``Block`` per family (the output head ``lm_head`` is the only other)."""


def litgpt_config(family: str) -> Any:
    """``family``'s LitGPT ``Config``, two blocks of width 64, vocabulary 512, context 64."""
    name, overrides = FAMILIES[family]
    return litgpt.Config.from_name(
        name, n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=64, **overrides
    )


class LitGPTModule(L.LightningModule):
    """LitGPT's ``GPT`` trained on next-token prediction; batches are ``(idx,)`` with ``SEQ_LEN + 1`` tokens."""

    def __init__(self, family: str = "pythia", seed: int = 0, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = litgpt.GPT(litgpt_config(family))
        self.lr = lr

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss(self, batch: Any) -> torch.Tensor:
        (idx,) = batch
        logits = self(idx[:, :-1])  # (B, T, V)
        return chunked_cross_entropy(logits, idx[:, 1:])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def litgpt_batch(batch_size: int = 4, seed: int = 0) -> tuple[torch.Tensor]:
    """One batch of random tokens, ``(batch_size, SEQ_LEN + 1)``."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(VOCAB, (batch_size, SEQ_LEN + 1), generator=generator),)


def litgpt_data(batch_size: int = 4, batches: int = 4) -> DataLoader:
    """``batches`` batches of :func:`litgpt_batch` rows, unshuffled."""
    return DataLoader(TensorDataset(*litgpt_batch(batch_size * batches)), batch_size=batch_size)
