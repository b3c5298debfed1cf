"""Hugging Face ``transformers`` models the way users wrap them: a LightningModule with dict batches.

:class:`HFLanguageModel` holds a ``transformers`` model built from a config (randomly initialised, no
download) or loaded from a local directory, and calls it as users do: ``self.model(**batch)`` with a
dict batch ``{"input_ids", "attention_mask", "labels"}``, reading ``.loss`` / ``.logits``.
:class:`HFTextDataModule` serves such batches from the stdlib corpus of ``charlm`` or the user's own text file
or folder (``path=``; bytes as tokens, or a local tokenizer), right-padded to ragged lengths so attention masks and ignored labels are exercised.

Four families cover what users bring: ``"gpt2"`` (``Conv1D`` layers, tied head), ``"llama"`` (RMSNorm,
rotary, grouped-query attention, untied head), ``"bert"`` (encoder, masked LM, tied decoder) and ``"t5"``
(encoder-decoder, tied head). Needs ``pip install "lightning-lowmem[hf]"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_lowmem.models.corpus import load_corpus

__all__ = [
    "FAMILIES",
    "PAD_ID",
    "TEXT_SUFFIXES",
    "HFLanguageModel",
    "HFTextDataModule",
    "build_hf_model",
    "read_text",
    "tiny_hf_config",
]

FAMILIES = {"gpt2": "causal", "llama": "causal", "bert": "masked", "t5": "seq2seq"}
"""Model family -> task of its head (``causal`` LM, ``masked`` LM, ``seq2seq`` LM)."""

PAD_ID, MASK_ID, BOS_ID, EOS_ID = 256, 257, 258, 259
BYTE_VOCAB = 264  # 256 bytes + pad, mask, bos, eos, rounded up to a multiple of 8


def _transformers() -> Any:
    from lightning_lowmem._versions import optional_import

    return optional_import("transformers", "Hugging Face models", extra="hf")


def tiny_hf_config(family: str = "gpt2", **overrides: Any) -> Any:
    """A small randomly-initialisable ``transformers`` config of ``family`` (no download).

    Sizes default to 2 layers of width 64 over the byte vocabulary (264 ids); ``overrides`` are config
    attributes (``n_layer=4``, ``hidden_size=128``, ``vocab_size=512`` ...).

    Raises:
        ValueError: ``family`` is not one of :data:`FAMILIES`.

    Example::

        >>> tiny_hf_config("llama", num_hidden_layers=3).num_hidden_layers
        3
    """
    if family not in FAMILIES:
        raise ValueError(f"`family`={family!r} is unknown; choose one of {sorted(FAMILIES)}")
    transformers = _transformers()
    special = {"pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    if family == "gpt2":
        defaults = dict(vocab_size=BYTE_VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4, **special)
        return transformers.GPT2Config(**{**defaults, **overrides})
    if family == "llama":
        defaults = dict(
            vocab_size=BYTE_VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            **special,
        )
        return transformers.LlamaConfig(**{**defaults, **overrides})
    if family == "bert":
        defaults = dict(
            vocab_size=BYTE_VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            pad_token_id=PAD_ID,
        )
        return transformers.BertConfig(**{**defaults, **overrides})
    defaults = dict(
        vocab_size=BYTE_VOCAB,
        d_model=64,
        d_ff=128,
        d_kv=16,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=BOS_ID,
        **special,
    )
    return transformers.T5Config(**{**defaults, **overrides})


def build_hf_model(family: str = "gpt2", pretrained: str | None = None, **overrides: Any) -> Any:
    """A ``transformers`` model with the head of ``family``'s task: from a tiny config, or from ``pretrained``.

    Args:
        family: ``"gpt2"``, ``"llama"``, ``"bert"`` or ``"t5"``; with ``pretrained`` it only picks the head
            (causal / masked / seq2seq LM). Default: ``"gpt2"``.
        pretrained: a local directory with ``config.json`` and weights (``from_pretrained``; nothing is
            downloaded). Default: ``None`` = random weights from :func:`tiny_hf_config`.
        overrides: config attributes for :func:`tiny_hf_config`.
    """
    transformers = _transformers()
    if family not in FAMILIES:
        raise ValueError(f"`family`={family!r} is unknown; choose one of {sorted(FAMILIES)}")
    auto = {
        "causal": transformers.AutoModelForCausalLM,
        "masked": transformers.AutoModelForMaskedLM,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
    }[FAMILIES[family]]
    if pretrained is not None:
        return auto.from_pretrained(pretrained, local_files_only=True)
    return auto.from_config(tiny_hf_config(family, **overrides))


class HFLanguageModel(L.LightningModule):
    """A ``transformers`` language model trained as users do: ``self.model(**batch).loss``.

    Logs ``train_loss`` / ``val_loss`` / ``test_loss``. The optimizer is AdamW (swap it with
    ``MemoryEfficientOptimizer``).

    Args:
        family: ``"gpt2"``, ``"llama"``, ``"bert"`` or ``"t5"`` (see :func:`build_hf_model`). Default: ``"gpt2"``.
        pretrained: a local directory to load with ``from_pretrained``. Default: ``None`` (random weights).
        config: config attributes overriding the tiny defaults, e.g. ``{"n_layer": 4}``. Default: none.
        lr: AdamW learning rate. Default: ``1e-3``.
        weight_decay: AdamW weight decay. Default: ``0.0``.

    Example::

        >>> model = HFLanguageModel("gpt2")
        >>> batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long)}
        >>> model(**batch).logits.shape
        torch.Size([2, 8, 264])
    """

    def __init__(
        self,
        family: str = "gpt2",
        pretrained: str | None = None,
        config: dict[str, Any] | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_hf_model(family, pretrained, **(config or {}))

    def forward(self, **batch: Any) -> Any:
        return self.model(**batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(**batch).loss, prog_bar=True)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self(**batch).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
"""The files :func:`read_text` reads from a folder."""


def read_text(path: str | Path, max_chars: int) -> torch.Tensor:
    """The bytes of a text file, or of a folder's :data:`TEXT_SUFFIXES` files (recursively, in sorted order, joined
    by a newline), as a uint8 tensor of at most ``max_chars`` bytes.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a folder with no text file, or no text at all.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"`path`={str(path)!r} does not exist; give a text file or a folder of {TEXT_SUFFIXES}")
    files = (
        [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file())
    )
    if not files:
        raise ValueError(f"`path`={str(path)!r} holds no {'/'.join(TEXT_SUFFIXES)} file; give a text file or a folder")
    chunks, size = [], 0
    for file in files:
        chunks.append(file.read_bytes())
        size += len(chunks[-1]) + 1
        if size >= max_chars:
            break
    blob = b"\n".join(chunks)[:max_chars]
    if not blob.strip():
        raise ValueError(f"`path`={str(path)!r} holds no text (its files are empty)")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class _TextDataset(Dataset):
    """Windows of the corpus as dict samples for one task, right-padded to ragged lengths."""

    def __init__(self, ids: torch.Tensor, task: str, seq_len: int, min_len: int, pad_id: int, mask_id: int, seed: int):
        self.ids, self.task, self.seq_len, self.min_len = ids, task, seq_len, min_len
        self.pad_id, self.mask_id, self.seed = pad_id, mask_id, seed
        span = 2 * seq_len if task == "seq2seq" else seq_len
        if len(ids) <= span:
            raise ValueError(f"corpus of {len(ids)} tokens is too short for seq_len={seq_len} ({task})")
        self.span = span

    def __len__(self) -> int:
        return len(self.ids) // self.span

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = index * self.span
        tokens = self.ids[start : start + self.seq_len].long()
        length = int(torch.randint(self.min_len, self.seq_len + 1, (1,), generator=generator))
        mask = torch.arange(self.seq_len) < length
        input_ids = torch.where(mask, tokens, self.pad_id)
        if self.task == "causal":  # the model shifts labels itself; padding is ignored (-100)
            labels = torch.where(mask, tokens, -100)
        elif self.task == "masked":  # 15% of the real tokens masked and predicted
            chosen = (torch.rand(self.seq_len, generator=generator) < 0.15) & mask
            chosen[0] = True  # at least one target per row
            labels = torch.where(chosen, tokens, -100)
            input_ids = torch.where(chosen, self.mask_id, input_ids)
        else:  # seq2seq: continue the text
            labels = self.ids[start + self.seq_len : start + 2 * self.seq_len].long()
        return {"input_ids": input_ids, "attention_mask": mask.long(), "labels": labels}


class HFTextDataModule(L.LightningDataModule):
    """Dict batches ``{"input_ids", "attention_mask", "labels"}`` from your text (``path``) or the stdlib corpus.

    Tokens are UTF-8 bytes (ids 0-255; pad 256, mask 257) unless ``tokenizer`` names a local tokenizer
    directory. Each row is right-padded from a random length in ``[min_len, seq_len]``: padding carries
    ``attention_mask=0`` and label ``-100``.

    Args:
        task: ``"causal"`` (GPT-2 / Llama), ``"masked"`` (BERT) or ``"seq2seq"`` (T5: continue the text).
            Default: ``"causal"``.
        seq_len: tokens per row. Default: 64.
        batch_size: rows per batch. Default: 8.
        min_len: shortest real length of a row. Default: ``seq_len * 3 // 4``.
        max_chars: bytes of corpus to read. Default: 400_000.
        path: your own text: a text file, or a folder whose ``.txt`` / ``.md`` / ``.py`` / ``.rst`` files are read
            (recursively, sorted), tokenized like the corpus. Default: ``None`` (the stdlib corpus).
        tokenizer: a local tokenizer directory (``AutoTokenizer.from_pretrained``). Default: ``None`` (bytes).
        val_fraction: share held out for validation. Default: 0.1.
        seed: padding / masking seed. Default: 0.

    Example::

        >>> data = HFTextDataModule(seq_len=16, batch_size=2, max_chars=20_000)
        >>> data.setup("fit")
        >>> sorted(next(iter(data.train_dataloader())))
        ['attention_mask', 'input_ids', 'labels']
    """

    def __init__(
        self,
        task: str = "causal",
        seq_len: int = 64,
        batch_size: int = 8,
        min_len: int | None = None,
        max_chars: int = 400_000,
        tokenizer: str | None = None,
        val_fraction: float = 0.1,
        seed: int = 0,
        path: str | None = None,
    ) -> None:
        super().__init__()
        if task not in ("causal", "masked", "seq2seq"):
            raise ValueError(f"`task`={task!r} is unknown; choose 'causal', 'masked' or 'seq2seq'")
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"`seq_len` and `batch_size` must be > 0, got {seq_len} and {batch_size}")
        min_len = seq_len * 3 // 4 if min_len is None else min_len
        if not 1 <= min_len <= seq_len:
            raise ValueError(f"`min_len` must be in [1, seq_len={seq_len}], got {min_len}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"`val_fraction` must be in (0, 1), got {val_fraction}")
        if path is not None and not Path(path).expanduser().exists():
            raise FileNotFoundError(f"`path`={path!r} does not exist; give a text file or a folder of text files")
        self.save_hyperparameters()
        self.min_len = min_len
        self.ids: torch.Tensor | None = None

    def _token_ids(self) -> tuple[torch.Tensor, int, int]:
        hp = self.hparams
        corpus = load_corpus(hp.max_chars) if hp.path is None else read_text(hp.path, hp.max_chars)
        if hp.tokenizer is None:
            return corpus.long(), PAD_ID, MASK_ID
        tokenizer = _transformers().AutoTokenizer.from_pretrained(hp.tokenizer, local_files_only=True)
        ids = torch.tensor(tokenizer(corpus.numpy().tobytes().decode("utf-8", "replace"))["input_ids"])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        mask = tokenizer.mask_token_id if tokenizer.mask_token_id is not None else pad
        return ids, pad, mask

    def setup(self, stage: str | None = None) -> None:
        if self.ids is not None:
            return
        hp = self.hparams
        self.ids, pad, mask = self._token_ids()
        split = int(len(self.ids) * (1 - hp.val_fraction))
        args = (hp.task, hp.seq_len, self.min_len, pad, mask)
        self.train_set = _TextDataset(self.ids[:split], *args, seed=hp.seed)
        self.val_set = _TextDataset(self.ids[split:], *args, seed=hp.seed + 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
