"""LoRA / QLoRA: train small low-rank adapters beside frozen (optionally quantized) weights.

:func:`apply_lora_` replaces chosen layers, in place, with adapter layers (:mod:`.layers`): ``nn.Linear`` /
Hugging Face ``Conv1D`` with a :class:`LoraLinear` that computes ``base(x) + (alpha / r) * B(A(dropout(x)))``,
``nn.Conv2d`` with a :class:`~lightning_lowmem.functional.lora.layers.LoraConv2d` (PEFT's conv adapter), and an
``nn.MultiheadAttention`` whose ``in_proj_weight`` / ``out_proj`` are chosen with a
:class:`~lightning_lowmem.functional.lora.layers.LoraMultiheadAttention` that runs on the adapted weights. Which
layers: :mod:`.targets`. ``B`` starts at zero, so the wrapped model's output equals the original's at step 0.
Every non-adapter parameter is frozen: only ``A`` and ``B`` get gradients and optimizer state. With
``quantize_base`` the frozen weights of the wrapped linear layers are stored in int8 / int4 through torchao
(QLoRA), adapters stay in the weights' original floating dtype.

The wrappers keep the base layer's parameter names (``<layer>.weight``, ``<layer>.bias``,
``<attention>.in_proj_weight``) and add ``<layer>.lora_A`` / ``<layer>.lora_B``, so a base checkpoint still loads
into the wrapped model and :func:`~lightning_lowmem.functional.lora.files.lora_state_dict` holds adapter tensors
only. Nothing here branches on tensor values, so :func:`apply_lora_` also runs on FakeTensor / meta parameters
(used by ``estimate_memory``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from lightning_lowmem.functional.multihead_attention import mha_out_projections
from lightning_lowmem.functional.lora.layers import (
    ADAPTER_SUFFIXES,
    LoraConv2d,
    LoraLinear,
    LoraMultiheadAttention,
    RUNNING_STAT_SUFFIXES,
    lora_layers,
)
from lightning_lowmem.functional.lora.quantized_base import (
    check_quantization_supported,
    dequantized,
    is_quantized,
    quantize_base_layers_,
    quantize_frozen_,
)
from lightning_lowmem.functional.lora.targets import ALL_LINEAR, is_candidate, matches, select, silent_output_layer
from lightning_lowmem.warnings import NoEffectWarning

__all__ = [
    "ADAPTER_SUFFIXES",
    "ALL_LINEAR",
    "LoraLinear",
    "LoraReport",
    "RUNNING_STAT_SUFFIXES",
    "apply_lora_",
    "is_candidate",
    "lora_layers",
    "merge_lora_",
    "merged_state_dict",
    "train_in_full_",
    "trained_modules",
    "unmerge_lora_",
]

QUANTIZE_CHOICES = (None, "int8", "int4")
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


def check_lora_arguments(r: int, alpha: float, dropout: float, quantize_base: str | None) -> None:
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"`r` (adapter rank) must be an int > 0, got {r!r}. Typical values: 4, 8, 16, 64.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"`alpha` must be a number > 0, got {alpha!r} (the update is scaled by alpha / r).")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"`dropout` must be in [0, 1), got {dropout!r}.")
    if quantize_base not in QUANTIZE_CHOICES:
        raise ValueError(f"`quantize_base` must be one of {QUANTIZE_CHOICES}, got {quantize_base!r}.")


def count_parameters(module: nn.Module) -> tuple[int, int]:
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
    """Put LoRA adapters on chosen linear, convolution and attention layers of ``module``, in place, and freeze
    everything else (but the ``train_modules``, trained in full).

    Args:
        module: the model (any ``nn.Module``; its parameters may be real, meta or FakeTensors).
        r: adapter rank, > 0. Default: 8.
        alpha: the update ``B @ A`` is scaled by ``alpha / r``. Default: 16.0.
        dropout: dropout on the adapters' input, in [0, 1). Default: 0.0.
        target: which layers: ``"all-linear"`` (every ``nn.Linear`` / ``Conv1D`` and the ``in_proj_weight`` /
            ``out_proj`` of each ``nn.MultiheadAttention``), ``"all-conv"`` (every ``nn.Conv2d``; grouped /
            depthwise ones are left out with a warning) or ``"all"`` (both) -- each except output heads:
            those named ``lm_head``, ``head``, ``classifier``, ``score`` or inside a module so named, and
            those whose weight is an embedding's, e.g. BERT's tied MLM decoder -- or a pattern / type or a
            list of them. A pattern matches a layer's qualified name exactly, as a dotted suffix (``"c_attn"``
            matches ``"h.0.attn.c_attn"``), as an fnmatch glob (``"h.*.mlp.*"``), or a class name
            (``"Conv1D"``); an attention's ``in_proj_weight`` is named ``<attention>.in_proj_weight``. Each
            pattern must match at least one layer. Default: ``"all-linear"``.
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
            no adapter and share no weight with an embedding, and the output layer when it gets no adapter
            and its weight is all zeros (timm's ``head``, torchvision's ``heads.head`` / ``fc``, freshly
            initialised: frozen, no adapter would get a gradient); a name pattern or a list of them (as for
            ``target``; each must match a module); ``None`` / ``[]`` = none. They are kept in adapter files
            and adapter-only checkpoints. Default: ``"auto"``.

    Returns:
        A :class:`LoraReport` (wrapped layer names, trainable and total parameter counts).

    Raises:
        ValueError: bad ``r`` / ``alpha`` / ``dropout`` / ``quantize_base``, a pattern that matches no
            layer (the message lists layer names), a target of convolutions that cannot be adapted only,
            ``quantize_base`` with convolutions or attention projections, ``module`` already has adapters, or
            a ``train_modules`` other than ``"auto"`` leaves an all-zero output layer frozen.
        TypeError: a ``target`` entry is neither a string nor a type.
        RuntimeError: the backend cannot run ``quantize_base`` (checked before anything is wrapped).

    Example::

        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> report = apply_lora_(model, r=4, target=["0", "2"])
        >>> report.wrapped, report.trainable_params
        (['0', '2'], 336)
    """
    check_lora_arguments(r, alpha, dropout, quantize_base)
    if not isinstance(quantize_frozen, bool):
        raise TypeError(f"`quantize_frozen` must be True or False, got {quantize_frozen!r}.")
    if quantize_frozen and quantize_base is None:
        raise ValueError(
            "`quantize_frozen`=True needs `quantize_base` ('int8' or 'int4'): the format to store them in."
        )
    existing = lora_layers(module)
    if existing:
        raise ValueError(
            f"{type(module).__name__} already has LoRA adapters on {sorted(existing)[:4]}: apply_lora_ runs once "
            f"per model (use load_adapters to load adapter weights into it)."
        )
    selected = select(module, target)
    trained = _train_modules(module, train_modules, selected, freeze_base)
    report = wrap_layers(
        module, selected, r=r, alpha=alpha, dropout=dropout, quantize_base=quantize_base, freeze_base=freeze_base
    )
    if quantize_frozen:
        quantize_frozen_(module, quantize_base, adapter_type=LoraLinear)  # type: ignore[arg-type]
    train_in_full_(module, trained)
    report.trained = trained
    report.trainable_params, report.total_params = count_parameters(module)
    return report


def _train_modules(
    module: nn.Module,
    train_modules: str | Sequence[str] | None,
    adapted: dict[str, nn.Module],
    freeze_base: bool = True,
) -> list[str]:
    """The names ``train_modules`` chooses (see :func:`apply_lora_`), outermost only, in module order; a silent
    output layer (:func:`~lightning_lowmem.functional.lora.targets.silent_output_layer`) joins ``"auto"``'s and
    must be among the others'."""
    chosen = _chosen_modules(module, train_modules, adapted)
    silent = silent_output_layer(module, list(adapted)) if freeze_base else None
    if silent is not None and not any(silent == name or silent.startswith(f"{name}.") for name in chosen):
        if train_modules != "auto":
            raise ValueError(
                f"apply_lora_: the output layer {silent!r} is all zeros and would stay frozen, so no adapter would "
                f"ever get a gradient (`train_modules`={train_modules!r}); train it in full "
                f"(train_modules='auto' or [..., {silent!r}]) or adapt it (target=[..., {silent!r}])."
            )
        chosen.append(silent)
    order = [name for name, _ in module.named_modules()]
    chosen = sorted(set(chosen), key=order.index)
    return [name for name in chosen if not any(name.startswith(f"{other}.") for other in chosen)]


def _chosen_modules(
    module: nn.Module, train_modules: str | Sequence[str] | None, adapted: dict[str, nn.Module]
) -> list[str]:
    """The names ``train_modules`` names itself (``"auto"``: the task heads by name), unordered."""
    named = {name: sub for name, sub in module.named_modules() if name and next(sub.parameters(), None) is not None}

    def holds_adapted(name: str) -> bool:
        return any(a == name or a.startswith(f"{name}.") or name.startswith(f"{a}.") for a in adapted)

    if train_modules is None:
        return []
    if train_modules == "auto":
        tied = {id(sub.weight) for sub in module.modules() if isinstance(sub, nn.Embedding)}
        chosen = [
            name
            for name, sub in named.items()
            if name.rsplit(".", 1)[-1] in AUTO_TRAIN_NAMES
            and not holds_adapted(name)
            and not any(id(p) in tied for p in sub.parameters())
        ]
    else:
        patterns = [train_modules] if isinstance(train_modules, str) else list(train_modules)
        if not all(isinstance(p, str) for p in patterns):
            raise TypeError(
                f"`train_modules` must be 'auto', None or module name patterns (str), got {train_modules!r}"
            )
        chosen = []
        for pattern in patterns:
            hits = [name for name, sub in named.items() if matches(name, pattern) or type(sub).__name__ == pattern]
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
    return chosen


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


def wrap_layers(
    module: nn.Module,
    selected: dict[str, nn.Module],
    *,
    r: int,
    alpha: float,
    dropout: float,
    quantize_base: str | None,
    freeze_base: bool,
) -> LoraReport:
    attentions = _attentions(module, selected)  # {attention name: its in_proj_weight adapted?}
    if "" in selected or "" in attentions:
        raise ValueError(
            f"`module` is itself the {type(module).__name__} to adapt; apply_lora_ replaces layers inside a model, "
            "in place. Hint: pass a container, e.g. nn.Sequential(layer)."
        )
    if quantize_base is not None:
        not_linear = [name for name, layer in selected.items() if isinstance(layer, (nn.Conv2d, nn.MultiheadAttention))]
        not_linear += [name for name in selected if name not in not_linear and name in mha_out_projections(module)]
        if not_linear:
            raise ValueError(
                f"`quantize_base`={quantize_base!r} stores the frozen base of linear layers only; {not_linear[:4]} are "
                "convolutions or attention projections. Hint: target linear layers, or use quantize_base=None."
            )
        check_quantization_supported(quantize_base, next(iter(selected.values())))
    if freeze_base:
        module.requires_grad_(False)
    if dropout > 0 and attentions:
        warnings.warn(
            f"`dropout`={dropout} does not apply to the adapters of the nn.MultiheadAttention layers "
            f"{list(attentions)[:4]}: their update goes through the projection weights.",
            NoEffectWarning,
            stacklevel=3,
        )
    for name, in_proj in attentions.items():
        attention = module.get_submodule(name)
        _replace(module, name, LoraMultiheadAttention.from_module(attention, in_proj=in_proj, r=r, alpha=alpha))
    for sub in module.modules():
        if isinstance(sub, nn.TransformerEncoder) and any(isinstance(m, LoraMultiheadAttention) for m in sub.modules()):
            # in eval with a padding mask it packs the batch into a NestedTensor for fused kernels that read the
            # base weights; its layers, kept off those kernels, would fail on it: same numbers, padded
            sub.use_nested_tensor = False
    for name, layer in selected.items():
        if isinstance(layer, nn.MultiheadAttention):
            continue
        adapter = LoraConv2d if isinstance(layer, nn.Conv2d) else LoraLinear
        _replace(module, name, adapter.from_layer(layer, r=r, alpha=alpha, dropout=dropout))
    if quantize_base is not None:
        wrapped = lora_layers(module)
        quantize_base_layers_(module, {name: wrapped[name] for name in selected}, quantize_base)
    trainable, total = count_parameters(module)
    return LoraReport(
        wrapped=list(selected),
        r=r,
        alpha=float(alpha),
        quantize_base=quantize_base,
        trainable_params=trainable,
        total_params=total,
    )


def _attentions(module: nn.Module, selected: dict[str, nn.Module]) -> dict[str, bool]:
    """The ``nn.MultiheadAttention`` layers a selection adapts (its packed ``in_proj_weight``, named by the attention,
    or its ``out_proj``): ``{name: in_proj_weight adapted?}`` in module order."""
    owners = mha_out_projections(module)  # {out_proj name: attention name}
    attentions: dict[str, bool] = {}
    for name, layer in selected.items():  # module order: an attention comes before its out_proj
        if isinstance(layer, nn.MultiheadAttention):
            attentions[name] = True
        elif name in owners:
            attentions.setdefault(owners[name], False)
    return attentions


def _replace(module: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(module.get_submodule(parent_name) if parent_name else module, child, new)


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
            key = f"{name}.{layer.weight_name}" if name else layer.weight_name
            weight = dequantized(layer.weight) if is_quantized(layer.weight) else layer.weight.detach()
            if not layer.merged:
                weight = weight + layer.delta_weight().to(weight.dtype)
            state[key] = weight.t().contiguous() if getattr(layer, "fan_in_fan_out", False) else weight.clone()
    return state
