"""The layers of a model quantization can reach, as models users bring are built.

* ``transformers``' ``Conv1D`` (GPT-2 and its family) is a linear layer with its weight stored transposed,
  ``(in_features, out_features)``, computing ``addmm(bias, x, weight)``. :func:`conv1d_to_linear` turns one
  into an ``nn.Linear`` whose weight is a transposed *view* of the same storage: outputs and gradients are
  bit-identical, no memory is copied, and every ``nn.Linear`` path (torchao, QAT) then applies.
* Weights shared by several layers (GPT-2 / BERT / T5 tie the output head to the token table):
  :func:`tied_groups` finds them so they are quantized once and stay one tensor.
* Names users pass (``skip_modules``) are checked against the model: :func:`check_patterns` raises with
  the model's real layer and class names when an entry matches nothing.

Nothing here imports Lightning, torchao or transformers.
"""

from __future__ import annotations

import difflib
import fnmatch
from typing import Iterable, Sequence

import torch
from torch import nn

__all__ = [
    "check_patterns",
    "conv1d_to_linear",
    "convert_conv1d_",
    "is_conv1d",
    "matches_any",
    "set_submodule",
    "tied_groups",
]


def is_conv1d(layer: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (matched by name, so transformers stays optional)."""
    weight = getattr(layer, "weight", None)
    return (
        type(layer).__name__ == "Conv1D"
        and hasattr(layer, "nf")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
    )


def conv1d_to_linear(layer: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` computing exactly what the ``Conv1D`` ``layer`` computes.

    Its weight is a new ``nn.Parameter`` over the *transposed view* of the Conv1D's weight (same storage,
    no copy; ``F.linear`` then runs the same ``addmm`` as ``Conv1D``: outputs and gradients are
    bit-identical). The bias is the same ``nn.Parameter`` object. Hooks on ``layer`` are not carried over.

    Example::

        >>> from types import SimpleNamespace
        >>> class Conv1D(nn.Module):  # the shape of transformers.pytorch_utils.Conv1D
        ...     def __init__(self, nf, nx):
        ...         super().__init__()
        ...         self.nf, self.weight, self.bias = nf, nn.Parameter(torch.randn(nx, nf)), nn.Parameter(torch.randn(nf))
        ...     def forward(self, x):
        ...         return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)
        >>> conv, x = Conv1D(6, 4), torch.randn(3, 4)
        >>> linear = conv1d_to_linear(conv)
        >>> linear, torch.equal(linear(x), conv(x))
        (Linear(in_features=4, out_features=6, bias=True), True)
    """
    if not is_conv1d(layer):
        raise TypeError(f"`layer` must be a transformers Conv1D, got {type(layer).__name__}.")
    weight = layer.weight
    in_features, out_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach().t(), requires_grad=weight.requires_grad)
    linear.bias = layer.bias  # the same Parameter (or None)
    linear.train(layer.training)
    return linear


def set_submodule(module: nn.Module, name: str, child: nn.Module) -> nn.Module:
    """Install ``child`` as the submodule ``name`` of ``module``; returns the one it replaces."""
    parent_name, _, attribute = name.rpartition(".")
    parent = module.get_submodule(parent_name)
    previous = getattr(parent, attribute)
    setattr(parent, attribute, child)
    return previous


def convert_conv1d_(module: nn.Module, names: Iterable[str] | None = None) -> dict[str, nn.Module]:
    """Replace the ``Conv1D`` layers ``names`` (default: every one) of ``module`` by exact ``nn.Linear``
    layers (:func:`conv1d_to_linear`), in place.

    Returns:
        Qualified name -> the ``Conv1D`` that was replaced (put it back with :func:`set_submodule` to undo).
    """
    chosen = None if names is None else set(names)
    replaced = {}
    for name, layer in list(module.named_modules()):
        if is_conv1d(layer) and (chosen is None or name in chosen):
            replaced[name] = set_submodule(module, name, conv1d_to_linear(layer))
    return replaced


def tied_groups(module: nn.Module) -> list[list[str]]:
    """Groups of layers (qualified names, module order) whose ``weight`` is one and the same tensor.

    Only groups of two or more are returned: e.g. ``[["model.transformer.wte", "model.lm_head"]]`` for
    GPT-2, whose output head reuses the token table. A module reachable under two names counts once.

    Example::

        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
        >>> model[1].weight = model[0].weight
        >>> tied_groups(model)
        [['0', '1']]
    """
    owners: dict[int, list[str]] = {}
    for name, layer in module.named_modules():
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor):
            owners.setdefault(id(weight), []).append(name)
    return [names for names in owners.values() if len(names) > 1]


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


def matches_any(fqn: str, layer: nn.Module, patterns: Sequence[str]) -> bool:
    """Whether a pattern names ``layer`` or one of its parents: a qualified name exactly, as a dotted suffix
    (``"lm_head"`` names ``"model.lm_head"``), as an fnmatch glob (``"*.attn.*"``), or the layer's class
    name (``"Embedding"``)."""
    if not patterns:
        return False
    parts = fqn.split(".") if fqn else []
    prefixes = [".".join(parts[: end + 1]) for end in range(len(parts))]
    return any(type(layer).__name__ == pattern or any(_matches(p, pattern) for p in prefixes) for pattern in patterns)


def check_patterns(module: nn.Module, patterns: Sequence[str], argument: str, candidates: Sequence[str] = ()) -> None:
    """Raise when an entry of ``patterns`` names no submodule of ``module`` (see :func:`matches_any`).

    Args:
        module: the model.
        patterns: the names the user passed.
        argument: the argument's name, for the message (e.g. ``"skip_modules"``).
        candidates: the quantizable layer names, listed in the message.

    Raises:
        TypeError: ``patterns`` is a string or holds a non-string.
        ValueError: an entry matches nothing; the message lists the model's layer names and classes.
    """
    if isinstance(patterns, str):
        raise TypeError(
            f"`{argument}` must be a list of module names, got the string {patterns!r}; wrap it: [{patterns!r}]."
        )
    names = [name for name, _ in module.named_modules() if name]
    classes = sorted({type(layer).__name__ for layer in module.modules()})
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(
                f"`{argument}` entries must be module names (str), got {type(pattern).__name__}: {pattern!r}."
            )
        if pattern in classes or any(_matches(name, pattern) for name in names):
            continue
        listed = list(candidates) or names
        shown = ", ".join(listed[:8]) + (f", ... ({len(listed)} in all)" if len(listed) > 8 else "")
        words = sorted({name.rsplit(".", 1)[-1] for name in names} | set(names) | set(classes))
        close = difflib.get_close_matches(pattern, words, n=3)
        raise ValueError(
            f"`{argument}` entry {pattern!r} matches no submodule of {type(module).__name__}"
            + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
            + ". Entries match a module's qualified name exactly, as a dotted suffix ('lm_head') or as an fnmatch glob "
            f"('*.attn.*'), or a class name. Quantizable layers: [{shown or 'none'}]; layer classes: {classes}."
        )
