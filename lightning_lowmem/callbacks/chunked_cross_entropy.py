"""`ChunkedCrossEntropy`: a language model's training loss without its whole ``(tokens, vocabulary)`` logits."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lowmem.callbacks._technique_base import TechniqueCallback
from lightning_lowmem.functional.config import CrossEntropyConfig


class ChunkedCrossEntropy(TechniqueCallback):
    """Compute the output head's cross-entropy in chunks of tokens while fitting: the ``B·T·V`` logits, their
    fp32 upcast and the log-softmax saved for backward (the peak of a language model with a real vocabulary)
    are never made. Loss and gradients equal the unchunked ones within fp32 rounding; the head's matmul runs
    once more (recomputed in backward).

    * **Hugging Face causal LMs** (``*ForCausalLM``, ``GPT2LMHeadModel``) trained through
      ``self.model(**batch).loss`` with ``labels``: nothing to change. Labels are shifted, ``ignore_index``,
      ``shift_labels`` and ``num_items_in_batch`` handled as Hugging Face does.
    * **Any other model** (LitGPT's ``GPT``, your own): the output head (``lm_head`` / ``output`` ``nn.Linear``,
      or ``head=``) returns deferred logits in training; change one line of the training step to
      ``loss = lightning_lowmem.functional.chunked_cross_entropy(logits, targets)``.

    Reading the logits in training (``outputs.logits.argmax(-1)``) raises ``LogitsNotComputedError`` naming
    that line. Evaluation (``model.eval()``: validation, test, predict) computes real logits. Applied in
    ``on_fit_start`` (after ``configure_model`` and ``LowRankAdapters``), undone in ``teardown`` and when fit
    raises; no parameter changes, so checkpoints load with or without it.

    Args:
        chunk_size: tokens per chunk. Default: ``None`` (a chunk's logits at most 1/8 of the whole, 32 MiB).
        head: the output head's module name in the LightningModule (``"model.lm_head"``) when it cannot be
            found. Default: ``None``.
        kernel: what computes the loss: ``"auto"`` (Liger-Kernel's or Cut Cross-Entropy's fused CUDA kernel when
            one is installed, ``pip install 'lightning-lowmem[liger]'``, and the model trains on CUDA; else ours),
            ``"lowmem"`` (ours), ``"liger"`` or ``"cce"`` (that one, or an error). Default: ``"auto"``.

    Raises:
        ValueError: ``chunk_size`` is not a positive int, ``head`` not a non-empty string, ``kernel`` unknown; at
            ``fit`` start, no output head found, a head that is not a plain ``nn.Linear`` (LoRA-wrapped,
            quantized), a Hugging Face model that is not a causal LM.

    Example::

        >>> from lightning_lowmem.demo import HFLanguageModel, HFTextDataModule
        >>> callback = ChunkedCrossEntropy()
        >>> trainer = L.Trainer(max_steps=1, callbacks=[callback], logger=False, enable_progress_bar=False,
        ...                     enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
        >>> trainer.fit(HFLanguageModel("llama"), HFTextDataModule("causal", seq_len=16, batch_size=2, max_chars=20_000))
        >>> callback.heads
        ['model.lm_head']
    """

    technique = "cross_entropy"
    tags = frozenset({"chunked_loss"})
    undo_on_exception = True

    def __init__(self, chunk_size: int | None = None, head: str | None = None, kernel: str = "auto") -> None:
        self.config = CrossEntropyConfig("chunked", chunk_size=chunk_size, head=head, kernel=kernel)  # validates
        self.chunk_size = chunk_size
        self.head = head
        self.kernel = kernel
        self.heads: list[str] = []

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._applied is not None:
            return
        self._applied = self.apply_config(pl_module)
        self.heads = list(self._applied.cross_entropy.heads)
        routed = self._applied.cross_entropy.losses
        how = f"the loss of {routed} computed from them" if routed else "compute the loss with chunked_cross_entropy"
        size = self.chunk_size if self.chunk_size is not None else "auto"
        rank_zero_info(
            f"ChunkedCrossEntropy(chunk_size={size}, kernel={self.kernel}): {self.heads} defer their logits in "
            f"training; {how}"
        )
        self.warn_if_restored_differs(
            "heads",
            self.heads,
            "the checkpoint was trained with heads {restored} deferred, this run defers {current}. Weights load "
            "either way; only memory differs.",
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"chunk_size": self.chunk_size, "head": self.head, "heads": list(self.heads)}
