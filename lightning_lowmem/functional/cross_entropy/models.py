"""Route a language model's training loss through :func:`linear_cross_entropy`: the output head defers its
logits, the loss reads the hidden states instead.

:func:`chunk_cross_entropy_` changes two things, in place and undoably, and no parameter:

* the **output head** (a Hugging Face model's ``get_output_embeddings()``, else a ``lm_head`` / ``output``
  ``nn.Linear``, or the module named by ``head=``) returns a :class:`DeferredLogits` while the module trains
  (``head.training``; evaluation still returns real logits);
* a Hugging Face causal LM's **loss** (``model.loss_function``, what ``model(**batch, labels=...)`` computes)
  takes a :class:`DeferredLogits` and computes the chunked loss with Hugging Face's semantics (labels shifted
  left, ``ignore_index`` / ``shift_labels`` / ``num_items_in_batch`` as ``ForCausalLMLoss``).

Anything else that computes its own loss from the logits (LitGPT's ``GPT``, a plain module) changes one line:
``chunked_cross_entropy(logits, targets)`` (this module) instead of ``F.cross_entropy`` / LitGPT's
``chunked_cross_entropy``; it takes real logits too. Reading the deferred logits any other way raises
:class:`LogitsNotComputedError`, which says so.

Example::

    >>> from torch import nn
    >>> class TinyLM(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.body, self.lm_head = nn.Embedding(50, 8), nn.Linear(8, 50, bias=False)
    ...     def forward(self, ids):
    ...         return self.lm_head(self.body(ids))
    >>> model, ids = TinyLM(), torch.randint(50, (2, 6))
    >>> reference = chunked_cross_entropy(model(ids), ids)  # real logits
    >>> handle = chunk_cross_entropy_(model)
    >>> handle.heads
    ['lm_head']
    >>> logits = model(ids)  # training: no (2, 6, 50) tensor is made
    >>> type(logits).__name__, torch.allclose(chunked_cross_entropy(logits, ids), reference)
    ('DeferredLogits', True)
    >>> handle.undo(); type(model(ids)).__name__
    'Tensor'
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from lightning_lowmem.functional.cross_entropy.kernels import check_kernel
from lightning_lowmem.functional.cross_entropy.linear import REDUCTIONS, linear_cross_entropy
from lightning_lowmem.functional.cross_entropy.tied import tie_embedding_gradient_, tied_embeddings

__all__ = [
    "ChunkedLoss",
    "DeferredLogits",
    "LogitsNotComputedError",
    "chunk_cross_entropy_",
    "chunked_cross_entropy",
    "routes_loss",
]

_HEAD_NAMES = ("lm_head", "output")  # LitGPT / nanoGPT / HF, torchtune
_ONE_LINE = (
    "compute the loss with lightning_lowmem.functional.chunked_cross_entropy(logits, targets) (it takes these "
    "deferred logits), or drop ChunkedCrossEntropy / cross_entropy='chunked' if the training step needs real logits"
)


class LogitsNotComputedError(RuntimeError):
    """Deferred logits were used as a tensor: under the chunked loss they are never computed in training."""


class DeferredLogits:
    """What the output head returns in training under :func:`chunk_cross_entropy_`: its input hidden states and
    the head, from which :func:`chunked_cross_entropy` computes the loss chunk by chunk.

    Indexing that keeps the class dimension whole (``logits[:, :-1]``, ``logits[..., :-1, :]``) indexes the hidden
    states; ``shape`` is the logits' shape. Any other use raises :class:`LogitsNotComputedError`.
    """

    __slots__ = ("hidden", "head", "kernel", "name")
    defers_logits = True  # what model_io.output_logits recognises

    def __init__(self, hidden: torch.Tensor, head: nn.Linear, name: str, kernel: str = "auto") -> None:
        self.hidden, self.head, self.name = hidden, head, name  # hidden: (..., H)
        self.kernel = kernel  # what computes the loss (linear_cross_entropy's kernel=)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.head.weight.shape[0]))

    def __getitem__(self, key: Any) -> "DeferredLogits":
        keys = key if isinstance(key, tuple) else (key,)
        whole_last = isinstance(keys[-1], slice) and keys[-1] == slice(None)
        if any(k is Ellipsis for k in keys) or len(keys) == len(self.shape):
            indexes_classes = not whole_last  # the last key is the class dimension
        else:
            indexes_classes = len(keys) > len(self.shape)
        if indexes_classes:
            raise LogitsNotComputedError(
                f"logits[{key!r}] of `{self.name}` selects classes, but the logits were not computed (chunked loss): "
                + _ONE_LINE
            )
        return DeferredLogits(self.hidden[key], self.head, self.name, self.kernel)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise LogitsNotComputedError(
            f"{getattr(func, '__name__', func)}() was given the logits of the output head, which the chunked loss "
            "does not compute in training: " + _ONE_LINE
        )

    def __getattr__(self, name: str) -> Any:
        raise LogitsNotComputedError(
            f"`logits.{name}`: the logits of the output head are not computed in training under the chunked loss; "
            + _ONE_LINE
        )

    def __repr__(self) -> str:
        return f"DeferredLogits(shape={tuple(self.shape)}, head={self.name!r})"


def chunked_cross_entropy(
    logits: DeferredLogits | torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``(..., V)`` logits against ``(...)`` targets: chunked when the logits are deferred
    (:func:`chunk_cross_entropy_`), ``F.cross_entropy`` on float32 logits otherwise. Shift a causal LM's
    logits and targets yourself (``logits[:, :-1]``, ``targets[:, 1:]``).

    Args:
        logits: a :class:`DeferredLogits` or a ``(..., V)`` tensor.
        targets: ``(...)`` class indices.
        ignore_index / reduction / label_smoothing: as ``F.cross_entropy``'s. Defaults: ``-100``, ``"mean"``, ``0.0``.
        chunk_size: tokens per chunk of the deferred path (:func:`linear_cross_entropy`). Default: ``None`` (auto).
        kernel: what computes the deferred path (:func:`linear_cross_entropy`'s ``kernel=``). Default: ``None``
            (the one :func:`chunk_cross_entropy_` was given, ``"auto"`` unless told).

    Returns:
        A float32 loss (``"none"``: shaped like ``targets``).

    Raises:
        ValueError / TypeError: shapes or arguments :func:`linear_cross_entropy` / ``F.cross_entropy`` refuse.
    """
    if isinstance(logits, DeferredLogits):
        head = logits.head
        return linear_cross_entropy(
            logits.hidden,
            head.weight,
            targets,
            bias=head.bias,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            chunk_size=chunk_size,
            kernel=logits.kernel if kernel is None else kernel,
        )
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"`logits` must be a tensor or DeferredLogits, got {type(logits).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"`reduction`={reduction!r} is not one of {list(REDUCTIONS)}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"`targets` {tuple(targets.shape)} must have the logits' leading shape {tuple(logits.shape[:-1])}"
        )
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return loss.view(targets.shape) if reduction == "none" else loss


@dataclass
class ChunkedLoss:
    """What :func:`chunk_cross_entropy_` changed, and how to undo it.

    Attributes:
        heads: names of the output heads that defer their logits in training.
        losses: names of the Hugging Face causal LMs whose ``loss_function`` computes the chunked loss.
        chunk_size: tokens per chunk (``None``: :func:`default_chunk_size`).
        kernel: what computes the loss (:func:`linear_cross_entropy`'s ``kernel=``).
        tied_embeddings: names of the input embeddings that share a head's weight: in training their backward
            adds its rows into the loss's weight gradient, one ``(V, H)`` buffer (:mod:`.tied`).
    """

    heads: list[str] = field(default_factory=list)
    tied_embeddings: list[str] = field(default_factory=list)
    losses: list[str] = field(default_factory=list)
    chunk_size: int | None = None
    kernel: str = "auto"
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def undo(self) -> None:
        """Give the heads their own ``forward`` and the models their own loss back (idempotent)."""
        while self._undo:
            self._undo.pop()()
        self.heads, self.losses, self.tied_embeddings = [], [], []


def chunk_cross_entropy_(
    module: nn.Module, *, chunk_size: int | None = None, head: str | None = None, kernel: str = "auto"
) -> ChunkedLoss:
    """Make ``module``'s output head(s) defer their logits in training, and Hugging Face causal LMs compute
    their loss from the deferred logits with :func:`linear_cross_entropy`; in place, undoable.

    Args:
        module: the model or the LightningModule holding it.
        chunk_size: tokens per chunk. Default: ``None`` (a chunk's logits at most 1/8 of the whole, 32 MiB).
        head: the output head's module name in ``module`` (``"model.lm_head"``) when it cannot be found: not a
            Hugging Face model's ``get_output_embeddings()`` nor an ``nn.Linear`` named ``lm_head`` / ``output``.
            Default: ``None`` (found).
        kernel: what computes the loss: ``"auto"``, ``"lowmem"``, ``"liger"`` or ``"cce"``
            (:func:`linear_cross_entropy`'s ``kernel=``). Default: ``"auto"``.

    Returns:
        A :class:`ChunkedLoss`; ``.undo()`` restores the module.

    Raises:
        ValueError: no output head is found (or ``head`` names none), or a head is not a plain ``nn.Linear``
            with a float weight (LoRA-wrapped, quantized), or a Hugging Face model whose loss is not the causal LM
            one (masked LM, seq2seq: compute the loss with :func:`chunked_cross_entropy` in the training step),
            an unknown ``kernel``.
    """
    check_kernel(kernel)
    report = ChunkedLoss(chunk_size=chunk_size, kernel=kernel)
    try:
        for name, hf_model in _hf_models(module):
            if not _is_causal_lm(hf_model):
                raise ValueError(
                    f"`{name or type(module).__name__}` is a {type(hf_model).__name__}, whose loss is not the causal LM "
                    "loss: the chunked loss replaces Hugging Face causal LMs' (*ForCausalLM, GPT2LMHeadModel) only. "
                    "Compute its loss with lightning_lowmem.functional.chunked_cross_entropy in your training step"
                )
            output = hf_model.get_output_embeddings()
            head_name = _name_of(module, output)
            _defer_head(module, head_name, output, report)
            _route_loss(name, hf_model, chunk_size, report)
        if not report.heads:
            for head_name in [head] if head is not None else _named_heads(module):
                _defer_head(module, head_name, _module(module, head_name), report)
        if not report.heads:
            linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)][-3:]
            raise ValueError(
                f"no output head found in {type(module).__name__}: neither a Hugging Face causal LM nor an nn.Linear named "
                f"{' / '.join(_HEAD_NAMES)}. Name it with `head=` (its last linear layers: {linears})"
            )
    except BaseException:
        report.undo()
        raise
    return report


def routes_loss(module: nn.Module) -> bool:
    """Whether :func:`chunk_cross_entropy_` computes ``module``'s loss by itself: it holds a Hugging Face causal LM
    (other models compute theirs in the training step, which must call :func:`chunked_cross_entropy`)."""
    return any(_is_causal_lm(model) for _, model in _hf_models(module))


# ----------------------------------------------------------------------------- finding and patching
def _hf_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face models with an output head (their base models inside are skipped)."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if any(name.startswith(f"{outer}.") or outer == "" for outer, _ in found):
            continue
        if callable(getattr(sub, "get_output_embeddings", None)) and hasattr(type(sub), "loss_function"):
            if sub.get_output_embeddings() is not None:
                found.append((name, sub))
    return found


def _is_causal_lm(model: nn.Module) -> bool:
    """A decoder-only Hugging Face LM (``T5ForConditionalGeneration`` resolves to the same loss name but is an
    encoder-decoder whose forward computes its own loss)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    return getattr(model.loss_function, "__name__", "") == "ForCausalLMLoss"


def _named_heads(module: nn.Module) -> list[str]:
    return [
        name
        for name, sub in module.named_modules()
        if name.rsplit(".", 1)[-1] in _HEAD_NAMES and isinstance(sub, nn.Linear)
    ]


def _module(module: nn.Module, name: str) -> nn.Module:
    try:
        return module.get_submodule(name)
    except AttributeError:
        linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)][-3:]
        raise ValueError(
            f"`head`={name!r} names no submodule of {type(module).__name__} (its last linear layers: {linears})"
        ) from None


def _name_of(module: nn.Module, target: nn.Module) -> str:
    return next(name for name, sub in module.named_modules() if sub is target)


def _defer_head(module: nn.Module, name: str, head: nn.Module, report: ChunkedLoss) -> None:
    if name in report.heads:
        return
    from lightning_lowmem.functional.quantization.serialization import is_quantized_tensor

    weight = getattr(head, "weight", None)
    plain = isinstance(weight, torch.Tensor) and weight.is_floating_point() and not is_quantized_tensor(weight)
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or not plain:
        raise ValueError(
            f"the output head `{name}` is a {type(head).__name__} with a {type(weight).__name__} weight: the chunked loss "
            "needs a plain nn.Linear head with a float weight. Leave the head out of LoRA targets, QAT and quantization "
            "(e.g. LoRA target='all-linear' skips it; quantize after training)"
        )
    if "forward" in head.__dict__:
        raise ValueError(f"the output head `{name}` already has its forward replaced (the chunked loss applied twice?)")

    def forward(self: nn.Linear, hidden: torch.Tensor) -> Any:
        if self.training:
            return DeferredLogits(hidden, self, name, report.kernel)
        return nn.Linear.forward(self, hidden)

    head.forward = types.MethodType(forward, head)  # type: ignore[method-assign]
    report.heads.append(name)
    report._undo.append(lambda: head.__dict__.pop("forward", None))
    for embedding_name, embedding in tied_embeddings(module, head.weight):
        if embedding_name not in report.tied_embeddings and "forward" not in embedding.__dict__:
            report._undo.append(tie_embedding_gradient_(embedding))
            report.tied_embeddings.append(embedding_name)


def _route_loss(name: str, model: nn.Module, chunk_size: int | None, report: ChunkedLoss) -> None:
    own = model.__dict__.get("_loss_function", _MISSING)  # Hugging Face's loss_function setter stores it there
    original = model.loss_function

    def causal_lm_loss(
        logits: Any,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(logits, DeferredLogits):
            return original(
                logits,
                labels,
                vocab_size,
                num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index,
                shift_labels=shift_labels,
                **kwargs,
            )
        if shift_labels is None:  # tokens < n predict n, as ForCausalLMLoss
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = chunked_cross_entropy(
            logits,
            shift_labels.to(logits.hidden.device),
            ignore_index=ignore_index,
            reduction=reduction,
            chunk_size=chunk_size,
        )
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    model.loss_function = causal_lm_loss

    def undo() -> None:
        if own is _MISSING:
            model.__dict__.pop("_loss_function", None)
        else:
            model._loss_function = own

    report.losses.append(name)
    report._undo.append(undo)


_MISSING = object()
