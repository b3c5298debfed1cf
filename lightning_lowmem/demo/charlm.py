"""`charlm`: a character-level GPT on the `.py` files of Python's own standard library.

The corpus ships with every Python (``sysconfig.get_paths()["stdlib"]``, ``test/`` excluded), so this
realistic transformer workload needs no download. Text is encoded as UTF-8 bytes (vocabulary 256), so
the vocabulary does not depend on the Python version that supplies the corpus.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_lowmem.models.corpus import load_corpus

VOCAB_SIZE = 256


# ----------------------------------------------------------------------------- model
@dataclass
class GPTConfig:
    """Shape of a :class:`CharGPT`. Defaults are small enough to train on 2 CPU cores."""

    vocab_size: int = VOCAB_SIZE
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be > 0, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"`n_embd`={self.n_embd} must be divisible by `n_head`={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer block: the unit that activation checkpointing wraps."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharGPT(nn.Module):
    """A nanoGPT-style decoder. ``forward(idx)`` returns logits of shape (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2 scaled init of residual projections
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab_size)


# ----------------------------------------------------------------------------- data
# the corpus (stdlib sources as bytes) lives in models/corpus.py, shared with the Hugging Face wrappers
class BlockDataset(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes: inputs and next-byte targets."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if len(data) <= block_size:
            raise ValueError(f"corpus of {len(data)} bytes is too short for block_size={block_size}")
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class CharLMDataModule(L.LightningDataModule):
    """The stdlib corpus, split into train / validation by position (last ``val_fraction``).

    Args:
        block_size: sequence length. Default: 64.
        batch_size: sequences per batch. Default: 16.
        max_chars: bytes of corpus to read. Default: 2_000_000.
        include: fnmatch patterns of stdlib paths to use (e.g. ``["email/*"]``). Default: all.
        exclude: fnmatch patterns to leave out. Default: none (``test/`` is always left out).
        val_fraction: share of the corpus held out for validation. Default: 0.1.
        num_workers: DataLoader workers. Default: 0.

    Example::

        >>> dm = CharLMDataModule(max_chars=20_000, block_size=32, batch_size=4)
        >>> dm.setup("fit")
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> tuple(x.shape), bool((x[:, 1:] == y[:, :-1]).all())
        ((4, 32), True)
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 16,
        max_chars: int = 2_000_000,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        val_fraction: float = 0.1,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"`val_fraction` must be in (0, 1), got {val_fraction}")
        if batch_size <= 0 or block_size <= 0 or max_chars <= 0:
            raise ValueError(
                f"`batch_size`, `block_size`, `max_chars` must be > 0, got {batch_size}, {block_size}, {max_chars}"
            )
        self.save_hyperparameters()
        self.data: torch.Tensor | None = None

    @property
    def fingerprint(self) -> str:
        """A hash of the corpus bytes (to validate caches keyed on this data)."""
        self.setup()
        assert self.data is not None
        return hashlib.sha256(self.data.numpy().tobytes()).hexdigest()[:16]

    def setup(self, stage: str | None = None) -> None:
        if self.data is None:
            hp = self.hparams
            self.data = load_corpus(hp.max_chars, hp.include, hp.exclude)
            split = int(len(self.data) * (1 - hp.val_fraction))
            self.train_set = BlockDataset(self.data[:split], hp.block_size)
            self.val_set = BlockDataset(self.data[split:], hp.block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            num_workers=self.hparams.num_workers,
            drop_last=True,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


# ----------------------------------------------------------------------------- lightning module
class CharLM(L.LightningModule):
    """Trains a :class:`CharGPT` with next-byte cross-entropy; logs ``train_loss`` and ``val_loss``.

    Args:
        n_layer, n_head, n_embd, block_size, dropout: the :class:`GPTConfig`. Defaults: 4, 4, 128, 64, 0.0.
        lr: AdamW learning rate. Default: 3e-3.
        weight_decay: AdamW weight decay. Default: 0.01.
        optimizer: optimizer name, see :func:`lightning_lowmem.functional.optimizers.build_optimizer`
            when available; ``"adamw"`` here. Default: ``"adamw"``.

    Example::

        >>> model = CharLM(n_layer=1, n_embd=32, n_head=2, block_size=16)
        >>> model(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 256])
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 64,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=dropout)
        self.model = CharGPT(self.config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        from lightning_lowmem.functional.optimizers.catalog import build_optimizer

        return build_optimizer(
            self.hparams.optimizer, self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
