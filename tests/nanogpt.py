"""A nanoGPT-style GPT for the tests: its own attention code (not the package's CharGPT), in a LightningModule.

Written the way users write small GPTs (Karpathy's nanoGPT ``model.py``): a causal-mask buffer, attention by
hand (``q @ k.transpose``, ``masked_fill``, ``softmax``), tied input / output embeddings, ``GELU`` MLP. The
planner and the strategy must hold a memory budget on a model they did not write.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["NanoData", "NanoGPT", "nano_batch", "nano_loader"]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # (B, T, C)
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(L.LightningModule):
    """A GPT in the nanoGPT style; ``training_step`` takes ``(idx, targets)``."""

    def __init__(
        self,
        vocab_size: int = 96,
        n_layer: int = 6,
        n_embd: int = 128,
        n_head: int = 4,
        block_size: int = 128,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.lr = lr
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def nano_batch(batch_size: int = 16, block_size: int = 128, vocab_size: int = 96, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, (batch_size, block_size + 1), generator=generator)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def nano_loader(batches: int = 4, batch_size: int = 16, block_size: int = 128, vocab_size: int = 96) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab_size, (batches * batch_size, block_size + 1), generator=generator)
    return DataLoader(TensorDataset(idx[:, :-1], idx[:, 1:]), batch_size=batch_size)


class NanoData(L.LightningDataModule):
    """:func:`nano_loader` as a LightningDataModule (for ``lowmem estimate --config``)."""

    def __init__(self, batches: int = 2, batch_size: int = 8, block_size: int = 64, vocab_size: int = 96) -> None:
        super().__init__()
        self.batches, self.batch_size, self.block_size, self.vocab_size = batches, batch_size, block_size, vocab_size

    def train_dataloader(self) -> DataLoader:
        return nano_loader(self.batches, self.batch_size, self.block_size, self.vocab_size)
