"""LoRA / QLoRA: train small low-rank adapters beside frozen (optionally quantized) linear weights.

:func:`apply_lora_` replaces chosen ``nn.Linear`` (and Hugging Face ``Conv1D``) layers, in place, with a
:class:`LoraLinear` that computes ``base(x) + (alpha / r) * B(A(dropout(x)))``. ``B`` starts at zero, so
the wrapped model's output equals the original's at step 0. Every non-adapter parameter is frozen:
only ``A`` and ``B`` get gradients and optimizer state. With ``quantize_base`` the frozen weights of
the wrapped layers are stored in int8 / int4 through torchao (QLoRA), adapters stay in the weights'
original floating dtype.

The wrapper keeps the base layer's parameter names (``<layer>.weight``, ``<layer>.bias``) and adds
``<layer>.lora_A`` / ``<layer>.lora_B``, so a base checkpoint still loads into the wrapped model and
:func:`~lightning_lowmem.functional.lora.files.lora_state_dict` holds adapter tensors only. Nothing here branches on tensor values, so
:func:`apply_lora_` also runs on FakeTensor / meta parameters (used by ``estimate_memory``).
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.functional.attention import left_alone_message, mha_out_projections
from lightning_lowmem.functional.lora.quantized_base import (
    check_quantization_supported,
    dequantized,
    frozen_linear,
    is_quantized,
    quantize_base_layers_,
    quantize_frozen_,
)
from lightning_lowmem.warnings import NoEffectWarning

__all__ = [
    "LoraLinear",
    "LoraReport",
    "apply_lora_",
    "merge_lora_",
    "merged_state_dict",
    "train_in_full_",
    "trained_modules",
    "unmerge_lora_",
]

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
QUANTIZE_CHOICES = (None, "int8", "int4")
ALL_LINEAR = "all-linear"
# Output projections left out by ``target="all-linear"`` (vocabulary / class heads, as PEFT does).
HEAD_NAMES = ("lm_head", "head", "classifier", "score")
# Heads ``train_modules="auto"`` trains in full: Hugging Face's task heads, freshly initialised when a
# pretrained body is loaded into a ``*ForSequenceClassification`` / ``*ForImageClassification`` (PEFT's
# ``modules_to_save`` for classification).
AUTO_TRAIN_NAMES = ("classifier", "score")
_TRAINED_MARK = "_lowmem_lora_trains_in_full"  # set on each module apply_lora_ trains in full


@dataclass
class LoraReport:
    """What :func:`apply_lora_` did.

    Attributes:
        wrapped: qualified names of the layers that received adapters.
        r: adapter rank.
        alpha: adapter scale numerator (the update is scaled by ``alpha / r``).
        quantize_base: ``None``, ``"int8"`` or ``"int4"``.
        trainable_params: parameters that require grad after the call (the adapters).
        total_params: all parameters of the module (logical element count, quantized ones included).
        trained: qualified names of the modules trained in full beside the adapters (``train_modules``).
    """

    wrapped: list[str] = field(default_factory=list)
    r: int = 8
    alpha: float = 16.0
    quantize_base: str | None = None
    trainable_params: int = 0
    total_params: int = 0
    trained: list[str] = field(default_factory=list)

    @property
    def trainable_fraction(self) -> float:
        return self.trainable_params / self.total_params if self.total_params else 0.0


def _is_hf_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D: a linear layer with weight (in_features, out_features); matched
    # by name so transformers stays an optional dependency.
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def _is_candidate(module: nn.Module) -> bool:
    return (isinstance(module, nn.Linear) and not isinstance(module, LoraLinear)) or _is_hf_conv1d(module)


class LoraLinear(nn.Linear):
    """A frozen linear layer plus a trainable low-rank update: ``y = x W^T + b + s * (x A^T) B^T``.

    Subclasses ``nn.Linear`` (same ``weight`` (out, in) / ``bias`` names) so tools that act on linear
    layers, torchao's ``quantize_`` among them, keep working. Build it with :meth:`from_layer`.

    Args:
        weight: frozen base weight, shape (out_features, in_features); kept as the same ``Parameter``.
        bias: frozen base bias (out_features,) or ``None``.
        r: rank of the update (> 0).
        alpha: the update is scaled by ``alpha / r``.
        dropout: dropout probability on the adapter's input. Default: 0.0.
        fan_in_fan_out: the base layer was a Hugging Face ``Conv1D`` (weight stored (in, out)); only
            used to write merged weights back in that layout. Default: ``False``.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        *,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        fan_in_fan_out: bool = False,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: that would allocate a fresh weight
        out_features, in_features = weight.shape
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = weight
        self.bias = bias
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.fan_in_fan_out = fan_in_fan_out
        self.merged = False
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        # new_empty / new_zeros follow the weight: real, meta or fake tensors alike (a torchao-quantized base has
        # no new_empty: a plain tensor on its device stands in)
        like = torch.empty(0, device=weight.device) if is_quantized(weight) else weight
        self.lora_A = nn.Parameter(like.new_empty((r, self.in_features), dtype=dtype))  # (r, in)
        self.lora_B = nn.Parameter(like.new_zeros((self.out_features, r), dtype=dtype))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear; B = 0 keeps step 0 exact

    @classmethod
    def from_layer(cls, layer: nn.Module, *, r: int, alpha: float, dropout: float = 0.0) -> "LoraLinear":
        """Wrap an ``nn.Linear`` or Hugging Face ``Conv1D``; its parameters are frozen and reused."""
        fan_in_fan_out = _is_hf_conv1d(layer)
        weight = layer.weight
        if fan_in_fan_out:  # Conv1D stores (in, out): keep one (out, in) copy, as nn.Linear does
            weight = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
        weight.requires_grad_(False)
        bias = layer.bias
        if bias is not None:
            bias.requires_grad_(False)
        return cls(weight, bias, r=r, alpha=alpha, dropout=dropout, fan_in_fan_out=fan_in_fan_out)

    def delta_weight(self) -> torch.Tensor:
        """The update ``(alpha / r) * B @ A``, shape (out_features, in_features)."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = frozen_linear(x, self.weight, self.bias)  # (..., out); differentiable for any quantized base
        if self.merged:
            return out
        update = F.linear(F.linear(self.lora_dropout(x.to(self.lora_A.dtype)), self.lora_A), self.lora_B)  # (..., out)
        return out + (update * self.scaling).to(out.dtype)

    def extra_repr(self) -> str:
        quantized = f", base={type(self.weight).__name__}" if is_quantized(self.weight) else ""
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha}, merged={self.merged}{quantized}"


def lora_layers(module: nn.Module) -> dict[str, LoraLinear]:
    """Qualified name -> :class:`LoraLinear` for every adapter layer inside ``module``."""
    return {name: sub for name, sub in module.named_modules() if isinstance(sub, LoraLinear)}


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


def _select(module: nn.Module, target: str | type | Sequence[str | type]) -> dict[str, nn.Module]:
    selected = _select_layers(module, target)
    unreachable = [name for name in selected if name in mha_out_projections(module)]
    if unreachable:
        what = f"apply_lora_(target={target!r})"
        if len(unreachable) == len(selected):
            raise ValueError(left_alone_message(unreachable, what) + " Nothing else matched: choose other layers.")
        warnings.warn(left_alone_message(unreachable, what), NoEffectWarning, stacklevel=3)
    return {name: layer for name, layer in selected.items() if name not in unreachable}


def _select_layers(module: nn.Module, target: str | type | Sequence[str | type]) -> dict[str, nn.Module]:
    candidates = {name: sub for name, sub in module.named_modules() if _is_candidate(sub)}
    if target == ALL_LINEAR:
        # output heads: by name, or by a weight shared with an embedding (BERT's MLM decoder, tied lm_heads)
        tied = {id(sub.weight) for sub in module.modules() if isinstance(sub, nn.Embedding)}
        # a head may be a container (HF ResNet / ConvNeXt: classifier = Sequential(Flatten, Linear)): any component
        selected = {n: m for n, m in candidates.items() if not set(n.split(".")) & set(HEAD_NAMES) and id(m.weight) not in tied}
        if not selected:
            convs = sum(isinstance(sub, nn.Conv2d) for sub in module.modules())
            hint = f" Its {convs} nn.Conv2d layers get no adapters (LoRA on convolutions is not supported)." if convs else ""
            raise ValueError(
                f"`target`='{ALL_LINEAR}' found no nn.Linear / Conv1D layer (output heads {HEAD_NAMES} are left "
                f"out) in {type(module).__name__}. Layers found: {sorted(candidates)[:8]}.{hint}"
            )
        return selected
    patterns = [target] if isinstance(target, (str, type)) else list(target)
    if not patterns:
        raise ValueError("`target` is empty: pass layer name patterns, layer types, or 'all-linear'.")
    selected: dict[str, nn.Module] = {}
    for pattern in patterns:
        if isinstance(pattern, type):
            hits = {n: m for n, m in candidates.items() if isinstance(m, pattern)}
        elif isinstance(pattern, str):
            hits = {n: m for n, m in candidates.items() if _matches(n, pattern) or type(m).__name__ == pattern}
        else:
            raise TypeError(
                f"`target` entries must be name patterns (str) or layer types, got {type(pattern).__name__}: {pattern!r}"
            )
        if not hits:
            names = sorted(candidates)
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
            raise ValueError(
                f"`target` pattern {pattern!r} matches no nn.Linear / Conv1D layer of {type(module).__name__}; "
                f"its linear layers end in: {leaves}. Patterns match a layer's qualified name exactly, as a dotted "
                f"suffix, or as an fnmatch glob; layer names are: [{shown or 'none'}]"
            )
        selected.update(hits)
    return {name: layer for name, layer in candidates.items() if name in selected}  # module order


def _validate(r: int, alpha: float, dropout: float, quantize_base: str | None) -> None:
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"`r` (adapter rank) must be an int > 0, got {r!r}. Typical values: 4, 8, 16, 64.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"`alpha` must be a number > 0, got {alpha!r} (the update is scaled by alpha / r).")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"`dropout` must be in [0, 1), got {dropout!r}.")
    if quantize_base not in QUANTIZE_CHOICES:
        raise ValueError(f"`quantize_base` must be one of {QUANTIZE_CHOICES}, got {quantize_base!r}.")


def _count_params(module: nn.Module) -> tuple[int, int]:
    trainable = total = 0
    for param in module.parameters():
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return trainable, total


def apply_lora_(
    module: nn.Module,
    *,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target: str | type | Sequence[str | type] = ALL_LINEAR,
    quantize_base: str | None = None,
    freeze_base: bool = True,
    quantize_frozen: bool = False,
    train_modules: str | Sequence[str] | None = "auto",
) -> LoraReport:
    """Put LoRA adapters on chosen linear layers of ``module``, in place, and freeze everything else
    (but the ``train_modules``, trained in full).

    Args:
        module: the model (any ``nn.Module``; its parameters may be real, meta or FakeTensors).
        r: adapter rank, > 0. Default: 8.
        alpha: the update ``B @ A`` is scaled by ``alpha / r``. Default: 16.0.
        dropout: dropout on the adapters' input, in [0, 1). Default: 0.0.
        target: which layers: ``"all-linear"`` (every ``nn.Linear`` / ``Conv1D`` except output heads:
            those named ``lm_head``, ``head``, ``classifier``, ``score`` or inside a module so named, and
            those whose weight is an embedding's, e.g. BERT's tied MLM decoder), or a pattern / type or a
            list of them. A pattern matches a layer's qualified name exactly, as a dotted suffix (``"c_attn"``
            matches ``"h.0.attn.c_attn"``), as an fnmatch glob (``"h.*.mlp.*"``), or a class name
            (``"Conv1D"``). Each pattern must match at least one layer. Default: ``"all-linear"``.
        quantize_base: ``None``, ``"int8"`` or ``"int4"``: store the wrapped layers' frozen weights
            quantized with torchao weight-only quantization (QLoRA). Default: ``None``.
        freeze_base: set ``requires_grad=False`` on every non-adapter parameter of ``module``
            (embeddings and norms included). Default: ``True``.
        quantize_frozen: with ``quantize_base``, also store the *other* frozen weights in the same
            format: linear layers that get no adapter (``lm_head``) and ``nn.Embedding`` tables (torchao
            ``IntxWeightOnlyConfig``). Weights shared between modules (tied embeddings) stay float.
            Default: ``False`` (as in QLoRA, only the adapted layers are quantized).
        train_modules: modules trained in full beside the adapters, e.g. a freshly initialised
            classification head that a frozen random projection would ruin (PEFT's ``modules_to_save``):
            ``"auto"`` = the modules named ``classifier`` or ``score`` (Hugging Face's task heads) that get
            no adapter and share no weight with an embedding; a name pattern or a list of them (as for
            ``target``; each must match a module); ``None`` / ``[]`` = none. They are kept in adapter files
            and adapter-only checkpoints. Default: ``"auto"``.

    Returns:
        A :class:`LoraReport` (wrapped layer names, trainable and total parameter counts).

    Raises:
        ValueError: bad ``r`` / ``alpha`` / ``dropout`` / ``quantize_base``, a pattern that matches no
            layer (the message lists layer names), or ``module`` already has adapters.
        TypeError: a ``target`` entry is neither a string nor a type.
        RuntimeError: the backend cannot run ``quantize_base`` (checked before anything is wrapped).

    Example::

        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> report = apply_lora_(model, r=4, target=["0", "2"])
        >>> report.wrapped, report.trainable_params
        (['0', '2'], 336)
    """
    _validate(r, alpha, dropout, quantize_base)
    if not isinstance(quantize_frozen, bool):
        raise TypeError(f"`quantize_frozen` must be True or False, got {quantize_frozen!r}.")
    if quantize_frozen and quantize_base is None:
        raise ValueError("`quantize_frozen`=True needs `quantize_base` ('int8' or 'int4'): the format to store them in.")
    existing = lora_layers(module)
    if existing:
        raise ValueError(
            f"{type(module).__name__} already has LoRA adapters on {sorted(existing)[:4]}: apply_lora_ runs once "
            f"per model (use load_adapters to load adapter weights into it)."
        )
    selected = _select(module, target)
    trained = _train_modules(module, train_modules, selected)
    report = _wrap(module, selected, r=r, alpha=alpha, dropout=dropout, quantize_base=quantize_base, freeze_base=freeze_base)
    if quantize_frozen:
        quantize_frozen_(module, quantize_base, adapter_type=LoraLinear)  # type: ignore[arg-type]
    train_in_full_(module, trained)
    report.trained = trained
    report.trainable_params, report.total_params = _count_params(module)
    return report


def _train_modules(module: nn.Module, train_modules: str | Sequence[str] | None, adapted: dict[str, nn.Module]) -> list[str]:
    """The names ``train_modules`` chooses (see :func:`apply_lora_`), outermost only, in module order."""
    named = {name: sub for name, sub in module.named_modules() if name and next(sub.parameters(), None) is not None}

    def holds_adapted(name: str) -> bool:
        return any(a == name or a.startswith(f"{name}.") or name.startswith(f"{a}.") for a in adapted)

    if train_modules is None:
        return []
    if train_modules == "auto":
        tied = {id(sub.weight) for sub in module.modules() if isinstance(sub, nn.Embedding)}
        chosen = [name for name, sub in named.items() if name.rsplit(".", 1)[-1] in AUTO_TRAIN_NAMES
                  and not holds_adapted(name) and not any(id(p) in tied for p in sub.parameters())]  # fmt: skip
    else:
        patterns = [train_modules] if isinstance(train_modules, str) else list(train_modules)
        if not all(isinstance(p, str) for p in patterns):
            raise TypeError(f"`train_modules` must be 'auto', None or module name patterns (str), got {train_modules!r}")
        chosen = []
        for pattern in patterns:
            hits = [name for name, sub in named.items() if _matches(name, pattern) or type(sub).__name__ == pattern]
            if not hits:
                close = sorted(named)[:8]
                raise ValueError(
                    f"`train_modules` pattern {pattern!r} matches no module with parameters of {type(module).__name__}; "
                    f"module names are e.g. {close}. Patterns match a qualified name exactly, as a dotted suffix, "
                    "as an fnmatch glob, or a class name."
                )
            clash = [name for name in hits if holds_adapted(name)]
            if clash:
                raise ValueError(
                    f"`train_modules` pattern {pattern!r} matches {clash[:4]}, which hold (or are) layers that get "
                    "adapters; a module is adapted or trained in full, not both: narrow `target` or `train_modules`."
                )
            chosen.extend(hits)
    order = list(named)
    chosen = sorted(set(chosen), key=order.index)
    return [name for name in chosen if not any(name.startswith(f"{other}.") for other in chosen)]


def train_in_full_(module: nn.Module, names: Sequence[str]) -> None:
    """Unfreeze the float parameters of the modules ``names`` and mark them as trained beside the adapters."""
    for name in names:
        sub = module.get_submodule(name)
        for param in sub.parameters():
            if param.is_floating_point() and not is_quantized(param):
                param.requires_grad_(True)
        sub.__dict__[_TRAINED_MARK] = True


def trained_modules(module: nn.Module) -> list[str]:
    """Qualified names of the modules :func:`apply_lora_` trains in full (``train_modules``) inside ``module``."""
    return [name for name, sub in module.named_modules() if sub.__dict__.get(_TRAINED_MARK)]


def _wrap(
    module: nn.Module,
    selected: dict[str, nn.Module],
    *,
    r: int,
    alpha: float,
    dropout: float,
    quantize_base: str | None,
    freeze_base: bool,
) -> LoraReport:
    if quantize_base is not None:
        check_quantization_supported(quantize_base, next(iter(selected.values())))
    if freeze_base:
        module.requires_grad_(False)
    for name, layer in selected.items():
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, LoraLinear.from_layer(layer, r=r, alpha=alpha, dropout=dropout))
    if quantize_base is not None:
        wrapped = lora_layers(module)
        quantize_base_layers_(module, {name: wrapped[name] for name in selected}, quantize_base)
    trainable, total = _count_params(module)
    return LoraReport(
        wrapped=list(selected), r=r, alpha=float(alpha), quantize_base=quantize_base,
        trainable_params=trainable, total_params=total,
    )  # fmt: skip


def merge_lora_(module: nn.Module) -> int:
    """Add each adapter's update into its base weight (``W += alpha / r * B @ A``); returns layers merged.

    After merging, forward skips the adapter branch (same output, one matmul less per layer). Merged
    layers are skipped. :func:`unmerge_lora_` undoes it (up to float rounding).

    Raises:
        ValueError: a base weight is quantized (adding a float update would re-quantize it; use
            :func:`merged_state_dict` for float merged weights instead).
    """
    merged = 0
    with torch.no_grad():
        for name, layer in lora_layers(module).items():
            if layer.merged:
                continue
            if is_quantized(layer.weight):
                raise ValueError(
                    f"layer {name!r} has a quantized base weight ({type(layer.weight).__name__}); merging in place "
                    f"would re-quantize it. Use merged_state_dict(module) to get float merged weights."
                )
            layer.weight.add_(layer.delta_weight().to(layer.weight.dtype))
            layer.merged = True
            merged += 1
    return merged


def unmerge_lora_(module: nn.Module) -> int:
    """Subtract each merged adapter's update from its base weight again; returns layers unmerged."""
    unmerged = 0
    with torch.no_grad():
        for layer in lora_layers(module).values():
            if layer.merged:
                layer.weight.sub_(layer.delta_weight().to(layer.weight.dtype))
                layer.merged = False
                unmerged += 1
    return unmerged


def merged_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict as the original architecture expects it: adapters folded into float weights.

    Adapter keys are dropped, quantized weights are dequantized, and Conv1D weights are transposed back
    to (in, out), so the result loads with ``strict=True`` into a fresh copy of the un-wrapped model.
    The module itself is not changed.
    """
    state = {key: value for key, value in module.state_dict().items() if not key.endswith(ADAPTER_SUFFIXES)}
    with torch.no_grad():
        for name, layer in lora_layers(module).items():
            key = f"{name}.weight" if name else "weight"
            weight = dequantized(layer.weight) if is_quantized(layer.weight) else layer.weight.detach()
            if not layer.merged:
                weight = weight + layer.delta_weight().to(weight.dtype)
            state[key] = weight.t().contiguous() if layer.fan_in_fan_out else weight.clone()
    return state
