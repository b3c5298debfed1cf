"""Which layers of a model get LoRA adapters: the ``target`` of :func:`~lightning_lowmem.functional.lora.apply_lora_`.

Candidates are ``nn.Linear`` and Hugging Face ``Conv1D`` layers, ``nn.Conv2d`` layers, and the packed
``in_proj_weight`` of an ``nn.MultiheadAttention`` (named by the attention module; its ``out_proj`` is an
``nn.Linear``). ``"all-linear"`` takes the linear ones (attention projections included) as PEFT does,
``"all-conv"`` the convolutions, ``"all"`` both; output heads are left out of all three. Name patterns and
classes choose any candidate. Convolutions :class:`~lightning_lowmem.functional.lora.layers.LoraConv2d` cannot
adapt (grouped / depthwise, non-zero padding modes) are left out with a :class:`NoEffectWarning` naming each.
A module a technique froze and marked with :data:`FROZEN_MARK` (a layer freeze's blocks and embeddings) gets no
adapter inside it, whatever the target.
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import Sequence

import torch
from torch import nn

from lightning_lowmem._compat.fake_mode import is_fake
from lightning_lowmem.functional.lora.layers import LoraConv2d, LoraLinear, is_hf_conv1d, conv_refusal
from lightning_lowmem.warnings import NoEffectWarning

__all__ = [
    "ALL",
    "ALL_CONV",
    "ALL_LINEAR",
    "BROAD_TARGETS",
    "FROZEN_MARK",
    "HEAD_NAMES",
    "is_candidate",
    "matches",
    "select",
    "silent_output_layer",
]

ALL_LINEAR = "all-linear"
ALL_CONV = "all-conv"
ALL = "all"
BROAD_TARGETS = (ALL_LINEAR, ALL_CONV, ALL)
# Output projections left out by the broad targets (vocabulary / class heads, as PEFT does).
HEAD_NAMES = ("lm_head", "head", "classifier", "score")
# Set in a module's __dict__ by a technique that froze it (e.g. a layer freeze): no adapter inside.
FROZEN_MARK = "_lowmem_frozen"


def is_candidate(module: nn.Module) -> bool:
    """A layer LoRA can be asked to adapt (not yet adapted): linear, ``Conv1D``, ``Conv2d`` or an attention's packed
    ``in_proj_weight``."""
    if isinstance(module, (LoraLinear, LoraConv2d)):
        return False
    if isinstance(module, nn.MultiheadAttention):
        return module.in_proj_weight is not None and getattr(module, "lora_A", None) is None
    return isinstance(module, (nn.Linear, nn.Conv2d)) or is_hf_conv1d(module)


def _is_linear(module: nn.Module) -> bool:
    return not isinstance(module, nn.Conv2d)


def matches(name: str, pattern: str) -> bool:
    """``pattern`` names ``name``: exactly, as a dotted suffix, or as an fnmatch glob."""
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


def _matches_layer(name: str, layer: nn.Module, pattern: str) -> bool:
    names = [name, f"{name}.in_proj", f"{name}.in_proj_weight"] if isinstance(layer, nn.MultiheadAttention) else [name]
    return any(matches(n, pattern) for n in names) or type(layer).__name__ == pattern


def select(module: nn.Module, target: str | type | Sequence[str | type]) -> dict[str, nn.Module]:
    """The layers ``target`` chooses, ``{qualified name: layer}`` in module order (see module doc).

    Raises:
        ValueError: a pattern matches no candidate (the message lists the layer names), a broad target finds
            nothing, or every layer chosen is a convolution that cannot be adapted.
        TypeError: a ``target`` entry is neither a string nor a type.
    """
    selected = _select_layers(module, target)
    refused = {name: conv_refusal(layer) for name, layer in selected.items() if isinstance(layer, nn.Conv2d)}
    refused = {name: reason for name, reason in refused.items() if reason is not None}
    if refused:
        shown = ", ".join(f"{name!r} ({reason})" for name, reason in list(refused.items())[:4])
        more = f", ... ({len(refused)} in all)" if len(refused) > 4 else ""
        message = (
            f"apply_lora_(target={target!r}) left out {shown}{more}: LoRA adapts nn.Conv2d layers with groups=1 and "
            "zero padding only (PEFT's conv adapter)."
        )
        if len(refused) == len(selected):
            raise ValueError(message + " Nothing else matched: choose other layers.")
        warnings.warn(message, NoEffectWarning, stacklevel=3)
    frozen = [name for name, sub in module.named_modules() if sub.__dict__.get(FROZEN_MARK)]
    return {
        name: layer
        for name, layer in selected.items()
        if name not in refused and not any(name == f or name.startswith(f"{f}.") or f == "" for f in frozen)
    }


def _select_layers(module: nn.Module, target: str | type | Sequence[str | type]) -> dict[str, nn.Module]:
    candidates = {name: sub for name, sub in module.named_modules() if is_candidate(sub)}
    if isinstance(target, str) and target in BROAD_TARGETS:
        return _broad(module, candidates, target)
    patterns = [target] if isinstance(target, (str, type)) else list(target)
    if not patterns:
        raise ValueError(f"`target` is empty: pass layer name patterns, layer types, or one of {BROAD_TARGETS}.")
    selected: dict[str, nn.Module] = {}
    for pattern in patterns:
        if isinstance(pattern, type):
            hits = {n: m for n, m in candidates.items() if isinstance(m, pattern)}
        elif isinstance(pattern, str):
            hits = {n: m for n, m in candidates.items() if _matches_layer(n, m, pattern)}
        else:
            raise TypeError(
                f"`target` entries must be name patterns (str) or layer types, got {type(pattern).__name__}: {pattern!r}"
            )
        if not hits:
            names = sorted(candidates)
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
            raise ValueError(
                f"`target` pattern {pattern!r} matches no nn.Linear / Conv1D / nn.Conv2d / nn.MultiheadAttention layer "
                f"of {type(module).__name__}; its layers end in: {leaves}. Patterns match a layer's qualified name "
                f"exactly, as a dotted suffix, or as an fnmatch glob; layer names are: [{shown or 'none'}]"
            )
        selected.update(hits)
    return {name: layer for name, layer in candidates.items() if name in selected}  # module order


def _broad(module: nn.Module, candidates: dict[str, nn.Module], target: str) -> dict[str, nn.Module]:
    # output heads: by name, or by a weight shared with an embedding (BERT's MLM decoder, tied lm_heads)
    tied = {id(sub.weight) for sub in module.modules() if isinstance(sub, nn.Embedding)}
    kinds = {ALL_LINEAR: (True,), ALL_CONV: (False,), ALL: (True, False)}[target]
    # a head may be a container (HF ResNet / ConvNeXt: classifier = Sequential(Flatten, Linear)): any component
    selected = {
        name: layer
        for name, layer in candidates.items()
        if _is_linear(layer) in kinds
        and not set(name.split(".")) & set(HEAD_NAMES)
        and id(getattr(layer, "weight", None)) not in tied
    }
    if not selected:
        convs = sum(isinstance(sub, nn.Conv2d) for sub in module.modules())
        hint = f"; its {convs} nn.Conv2d layers get adapters with target='{ALL_CONV}' (or '{ALL}')" if convs else ""
        hint = hint if target == ALL_LINEAR else ""
        what = {ALL_LINEAR: "linear", ALL_CONV: "nn.Conv2d", ALL: "adaptable"}[target]
        raise ValueError(
            f"`target`='{target}' found no {what} layer in {type(module).__name__}{hint}. Linear layers are nn.Linear, "
            f"Conv1D and nn.MultiheadAttention projections; output heads {HEAD_NAMES} are left out; layers found: "
            f"{sorted(candidates)[:8]}."
        )
    return selected


def silent_output_layer(module: nn.Module, adapted: Sequence[str]) -> str | None:
    """The name of ``module``'s output layer when, frozen, it would leave every adapter without a gradient.

    The output layer is the last linear / convolution layer in module order (timm's ``head``, torchvision's
    ``heads.head`` / ``fc``, a ``classifier``). With a weight of zeros only -- the usual init of a fresh head -- a
    frozen one passes back zero gradient to everything below it (whatever its bias): the adapters would never
    move and the outputs stay bit-identical. ``None`` when the layer gets an adapter (``adapted`` names the layers
    that do), has a non-zero weight, or its values cannot be read (meta / fake tensors: the estimator's copy).

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> _ = nn.init.zeros_(model[2].weight)
        >>> silent_output_layer(model, ["0"]), silent_output_layer(model, ["0", "2"])
        ('2', None)
    """
    layers = [(name, sub) for name, sub in module.named_modules() if name and is_candidate(sub)]
    if not layers:
        return None
    name, layer = layers[-1]
    if any(a == name or a.startswith(f"{name}.") or name.startswith(f"{a}.") for a in adapted):
        return None
    weight = getattr(layer, "weight", None)
    if type(weight) not in (torch.Tensor, nn.Parameter) or weight.device.type == "meta" or is_fake(weight):
        return None
    return name if int(torch.count_nonzero(weight)) == 0 else None
