"""Mask-based pruning on a plain ``nn.Module``: masks are ``bool`` buffers, weights are zeroed in place.

Unlike ``torch.nn.utils.prune`` there is no ``weight_orig`` copy and no float mask: each pruned
parameter ``<name>`` gets one non-persistent ``bool`` buffer ``<name>_mask`` (1 byte per weight) on its
module, and :func:`apply_masks_` multiplies the weight by it in place (call it after every optimizer
step). Masks only ever grow: a weight pruned once stays pruned. Masks and target selection live in
:mod:`~lightning_lowmem.functional.pruning.masks` (re-exported here), the sparse export in
:mod:`~lightning_lowmem.functional.pruning.sparse_format`.

Which parameters: by default every module that directly holds a parameter named in ``parameter_names``
(an ``nn.Linear``, a Hugging Face ``Conv1D``, a torchao ``FakeQuantizedLinear``...), **except embeddings**:
the weights of ``nn.Embedding`` / ``nn.EmbeddingBag`` and every parameter tied to one (GPT-2's ``lm_head``,
BERT's MLM decoder) are left alone unless ``embeddings=True``. A tied parameter is one target: it is ranked
and counted once, and its single mask buffer is shared by every module that holds it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence, Union

import torch
from torch import nn

from lightning_lowmem.functional.config.constants import PRUNING_METHODS
from lightning_lowmem.functional.pruning.masks import (
    FilterFn,
    mask_key,
    set_mask,
    apply_masks_,
    collect_prunable,
    embedding_parameters,
    get_mask,
    layer_sparsity,
    load_masks_,
    mask_state,
    parameter_owners,
    remove_pruning_,
    sparsity,
    weight_dims,
)
from lightning_lowmem.functional.pruning.sparse_format import from_sparse_state_dict, to_sparse_state_dict
from lightning_lowmem.warnings import NoEffectWarning

if TYPE_CHECKING:
    from lightning_lowmem.functional.config.pruning import PruningConfig

__all__ = [
    "METHODS",
    "PruningReport",
    "apply_masks_",
    "collect_prunable",
    "embedding_parameters",
    "from_sparse_state_dict",
    "get_mask",
    "layer_sparsity",
    "load_masks_",
    "mask_state",
    "parameter_owners",
    "prune_",
    "remove_pruning_",
    "sparsity",
    "to_sparse_state_dict",
    "weight_dims",
]

METHODS = PRUNING_METHODS  # the name this module always exported
Amount = Union[int, float]


@dataclass
class PruningReport:
    """What :func:`prune_` did: ``sparsity`` over the pruned tensors and per tensor (by ``module.param`` name).

    ``num_prunable`` counts each distinct parameter once (a tied weight once), ``mask_bytes`` each mask buffer once.
    """

    method: str
    sparsity: float
    per_tensor: dict[str, float] = field(default_factory=dict)
    num_pruned: int = 0
    num_prunable: int = 0
    mask_bytes: int = 0


def _num_to_prune(amount: Amount, total: int, already: int, relative: bool) -> int:
    """How many units are pruned in total after this call (never fewer than ``already``)."""
    if relative:  # torch.nn.utils.prune semantics: amount applies to what is still unpruned
        extra = amount if isinstance(amount, int) else round(amount * (total - already))
        wanted = already + extra
    else:
        wanted = amount if isinstance(amount, int) else round(amount * total)
    if wanted > total:
        raise ValueError(f"`amount`={amount} asks to prune {wanted} units but only {total} exist")
    return max(wanted, already)


def _channel_scores(weight: torch.Tensor, mask: torch.Tensor, dim: int, norm: float, random: bool, gen) -> torch.Tensor:
    """One score per slice along ``dim``; fully pruned slices score -inf so they stay pruned."""
    w = weight.detach().movedim(dim, 0).reshape(weight.shape[dim], -1).float()  # (channels, rest)
    alive = mask.movedim(dim, 0).reshape(mask.shape[dim], -1).any(dim=1)  # (channels,)
    scores = torch.rand(w.shape[0], generator=gen) if random else torch.linalg.vector_norm(w, ord=norm, dim=1)
    return scores.to(w.device).masked_fill(~alive, float("-inf"))


def _expand_channels(keep: torch.Tensor, shape: torch.Size, dim: int) -> torch.Tensor:
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return keep.view(view).expand(shape).clone()


def _nm_mask(weight: torch.Tensor, mask: torch.Tensor, in_dim: int, n: int, m: int) -> torch.Tensor | None:
    """Keep the ``n`` largest of every ``m`` consecutive weights along the input dim."""
    w = weight.detach().movedim(in_dim, -1)  # (..., in)
    if w.shape[-1] % m:
        return None
    scores = w.abs().float().masked_fill(~mask.movedim(in_dim, -1), float("-inf"))
    groups = scores.reshape(-1, m)  # (groups, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.topk(n, dim=1).indices, True)
    keep &= groups > float("-inf")
    return keep.reshape(w.shape).movedim(-1, in_dim)


@torch.no_grad()
def prune_(
    module: nn.Module,
    target_sparsity: Amount | PruningConfig,
    method: str | type = "l1_unstructured",
    *,
    global_: bool = False,
    parameter_names: Sequence[str] = ("weight",),
    filter_fn: FilterFn | None = None,
    parameters_to_prune: Sequence[tuple[nn.Module, str]] | None = None,
    n: int = 2,
    m: int = 4,
    dim: int | None = None,
    norm: float = 1,
    relative: bool = False,
    generator: torch.Generator | None = None,
    embeddings: bool = False,
    heads: bool = False,
) -> PruningReport:
    """Compute ``bool`` masks reaching ``target_sparsity`` and zero the pruned weights, in place.

    The arguments are a :class:`~lightning_lowmem.functional.config.PruningConfig` (pass it as
    ``target_sparsity``: the config's method, parameter names, ``use_global_unstructured`` (not for ``"nm"``),
    ``n``/``m``, ``pruning_dim``/``pruning_norm``, ``prune_embeddings``, ``prune_heads`` and ``seed`` apply, pruning to its
    ``final_sparsity``), or its flat shorthand below, which builds one (every check is the config's).
    ``filter_fn``, ``parameters_to_prune`` pairs, ``relative`` and ``generator`` belong to the call.

    Args:
        module: the model to prune.
        target_sparsity: a ``PruningConfig``, or a float in [0, 1] = fraction of weights (structured: of
            channels) pruned after the call; int = that number of weights (channels) per tensor, or in total
            when ``global_``. Ignored by ``"nm"``, whose sparsity is ``1 - n/m``.
        method: one of :data:`METHODS`, or a ``torch.nn.utils.prune.BasePruningMethod`` subclass
            (local only; its float mask is turned into a bool one). Default: ``"l1_unstructured"``.
        global_: rank weights (or channels, by norm per element) across all targets. Default: ``False``.
        parameter_names: parameter names to prune in each module holding them. Default: ``("weight",)``.
        filter_fn: ``filter_fn(module, fqn) -> bool`` chooses modules. Default: ``None`` (all).
        parameters_to_prune: explicit ``(module, name)`` pairs; overrides the two above. Default: ``None``.
        n, m: keep ``n`` of every ``m`` consecutive weights along the input dim (``"nm"``). Default: 2, 4.
        dim: dim whose slices structured methods prune. Default: ``None`` = each module's output dim.
        norm: the ``p`` of the norm ranking channels in ``ln_structured``. Default: 1.
        relative: ``amount`` applies to the still-unpruned weights (``torch.nn.utils.prune``'s iterative
            meaning, used for ``ModelPruning`` compatibility). Default: ``False``.
        generator: random generator for the random methods. Default: ``None`` (global RNG).
        embeddings: also prune embedding tables (and the parameters tied to them, e.g. a tied LM head)
            when targets are searched (``parameters_to_prune`` pairs are always honoured). Default: ``False``.
        heads: also prune the task heads when targets are searched (poolers, classifiers, LM heads, the output
            layer: :func:`~lightning_lowmem.functional.pruning.masks.head_modules`); explicit pairs naming one are
            honoured with a ``LowMemWarning``. Default: ``False``.

    Returns:
        A :class:`PruningReport`.

    Raises:
        ValueError: unknown method, bad ``amount``, ``n >= m``, a parameter name no module has; shorthand
            arguments beside a config.
        TypeError: ``target_sparsity`` / ``dim`` of the wrong type.

    Example::

        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> prune_(model, 0.75, global_=True).sparsity
        0.75
        >>> from lightning_lowmem.functional.config import PruningConfig
        >>> prune_(nn.Linear(8, 8), PruningConfig(target_sparsity=0.5, parameter_names=["weight"])).sparsity
        0.5
    """
    config, global_, generator, parameters_to_prune = _call_config(
        module,
        target_sparsity,
        generator,
        parameters_to_prune,
        method=method,
        global_=global_,
        parameter_names=parameter_names,
        n=n,
        m=m,
        dim=dim,
        norm=norm,
        embeddings=embeddings,
        heads=heads,
    )
    if callable(config.final_sparsity):
        raise TypeError(
            f"`amount`={config.final_sparsity!r} must be a float in [0, 1] or an int >= 0 here; a callable(epoch) "
            "amount is ScheduledPruning's per-epoch rule"
        )
    method, target_sparsity, parameter_names = config.pruning_fn, config.final_sparsity, config.names
    n, m, dim, norm, embeddings = config.n, config.m, config.pruning_dim, config.norm, config.prune_embeddings
    targets = collect_prunable(
        module, parameter_names, filter_fn, parameters_to_prune, embeddings=embeddings, heads=config.prune_heads
    )
    if parameters_to_prune:
        from lightning_lowmem.functional.pruning.targets import warn_head_targets

        warn_head_targets(module, targets)
    if not targets:
        warnings.warn("prune_ matched no parameter: nothing was pruned", NoEffectWarning, stacklevel=2)
        return PruningReport(str(method), 0.0)
    weights = [getattr(sub, pname) for _, sub, pname in targets]
    masks = []  # one per target, in order (names may repeat for modules outside the model's tree)
    for (_, sub, pname), weight in zip(targets, weights, strict=True):
        current = get_mask(sub, pname)
        masks.append(torch.ones_like(weight, dtype=torch.bool) if current is None else current.clone())
    method_name = method if isinstance(method, str) else getattr(method, "__name__", str(method))
    structured = method in ("ln_structured", "random_structured")
    random = method in ("random_unstructured", "random_structured")
    groups = [list(range(len(targets)))] if global_ else [[i] for i in range(len(targets))]

    if not isinstance(method, str):  # a torch BasePruningMethod subclass
        if global_:
            raise ValueError(
                f"`method`={method_name} (a custom pruning method) only supports local pruning (global_=False)"
            )
        for i, weight in enumerate(weights):
            kwargs = (
                {"dim": dim if dim is not None else 0} if getattr(method, "PRUNING_TYPE", "") == "structured" else {}
            )
            pruner = method(target_sparsity, **kwargs)
            masks[i] &= pruner.compute_mask(weight.detach(), default_mask=masks[i].to(weight.dtype)).bool()
    elif method == "nm":
        for i, ((fqn, sub, pname), weight) in enumerate(zip(targets, weights, strict=True)):
            nm = _nm_mask(weight, masks[i], weight_dims(sub, pname)[1] if weight.dim() > 1 else 0, n, m)
            if nm is None:
                message = (
                    f"{mask_key(fqn, pname)} {tuple(weight.shape)}: input dim not divisible by m={m}; left unpruned"
                )
                warnings.warn(message, NoEffectWarning, stacklevel=2)
                continue
            masks[i] = nm
    elif structured:
        _structured_masks_(
            masks, targets, weights, groups, target_sparsity, dim, norm, random, generator, relative, global_
        )
    else:  # unstructured magnitude / random
        _unstructured_masks_(masks, weights, groups, target_sparsity, random, generator, relative)
    return _applied_masks(module, targets, weights, masks, method_name)


def _call_config(
    module: nn.Module,
    target_sparsity: Amount | PruningConfig,
    generator: torch.Generator | None,
    parameters_to_prune: Sequence[tuple[nn.Module, str]] | None,
    **shorthand: object,
) -> tuple[PruningConfig, object, torch.Generator | None, Sequence[tuple[nn.Module, str]] | None]:
    """``prune_``'s :class:`PruningConfig` (given, or built from its flat ``shorthand`` arguments), with the global
    flag, the random generator and the explicit ``(module, name)`` pairs the config implies."""
    from lightning_lowmem.functional.config.pruning import PruningConfig

    if isinstance(target_sparsity, PruningConfig):
        shorthand["parameter_names"] = tuple(shorthand["parameter_names"])
        defaults = dict(method="l1_unstructured", global_=False, parameter_names=("weight",), n=2, m=4, norm=1)
        defaults.update(dim=None, embeddings=False, heads=False)
        given = sorted(name for name, value in shorthand.items() if value != defaults[name])
        if given:
            raise ValueError(f"`{'`, `'.join(given)}` given beside a PruningConfig; set them in the config (one place)")
        config = target_sparsity
        if generator is None and config.pruning_fn in ("random_unstructured", "random_structured"):
            generator = torch.Generator().manual_seed(config.seed)
        global_ = config.use_global_unstructured and isinstance(config.pruning_fn, str) and config.pruning_fn != "nm"
        if parameters_to_prune is None and config.parameters_to_prune:  # "fqn.param" strings or (module, name) pairs
            pairs = [entry.rpartition(".") if isinstance(entry, str) else entry for entry in config.parameters_to_prune]
            parameters_to_prune = [(module.get_submodule(p[0]), p[2]) if len(p) == 3 else p for p in pairs]
        return config, global_, generator, parameters_to_prune
    config = PruningConfig(
        method=shorthand["method"],
        amount=target_sparsity,
        use_global_unstructured=shorthand["global_"],
        parameter_names=list(shorthand["parameter_names"]),
        pruning_dim=shorthand["dim"],
        pruning_norm=shorthand["norm"],
        n=shorthand["n"],
        m=shorthand["m"],
        prune_embeddings=shorthand["embeddings"],
        prune_heads=shorthand["heads"],
    )
    return config, shorthand["global_"], generator, parameters_to_prune


def _structured_masks_(
    masks: list[torch.Tensor],
    targets: list,
    weights: list[torch.Tensor],
    groups: list[list[int]],
    target_sparsity: Amount,
    dim: int | None,
    norm: float,
    random: bool,
    generator: torch.Generator | None,
    relative: bool,
    global_: bool,
) -> None:
    """Narrow ``masks`` by whole channels (slices along ``dim``), ranked within each group of targets."""
    scores = []
    for i, ((_, sub, pname), weight) in enumerate(zip(targets, weights, strict=True)):
        d = (dim if dim is not None else weight_dims(sub, pname)[0]) % max(weight.dim(), 1)
        s = _channel_scores(weight, masks[i], d, norm, random, generator)
        if global_:  # compare channels of different sizes by norm per element
            s = s / (weight.numel() // weight.shape[d]) ** (1.0 / norm)
        scores.append((s, d))
    for group in groups:
        flat = torch.cat([scores[i][0].cpu() for i in group])
        k = _num_to_prune(target_sparsity, flat.numel(), int(torch.isinf(flat).sum()), relative)
        drop = torch.zeros(flat.numel(), dtype=torch.bool)
        drop[torch.topk(flat, k, largest=False).indices] = True
        offset = 0
        for i in group:
            weight, (s, d) = weights[i], scores[i]
            keep = ~drop[offset : offset + s.numel()].to(weight.device)
            offset += s.numel()
            masks[i] &= _expand_channels(keep, weight.shape, d)


def _unstructured_masks_(
    masks: list[torch.Tensor],
    weights: list[torch.Tensor],
    groups: list[list[int]],
    target_sparsity: Amount,
    random: bool,
    generator: torch.Generator | None,
    relative: bool,
) -> None:
    """Narrow ``masks`` by single weights (magnitude or random), ranked within each group of targets."""
    for group in groups:
        parts = []
        for i in group:
            weight = weights[i]
            score = torch.rand(weight.shape, generator=generator) if random else weight.detach().abs().float().cpu()
            parts.append(score.flatten().masked_fill(~masks[i].flatten().cpu(), float("-inf")))
        flat = torch.cat(parts)
        k = _num_to_prune(target_sparsity, flat.numel(), int(torch.isinf(flat).sum()), relative)
        drop = torch.zeros(flat.numel(), dtype=torch.bool)
        drop[torch.topk(flat, k, largest=False, sorted=False).indices] = True
        offset = 0
        for i, part in zip(group, parts, strict=True):
            masks[i] &= ~drop[offset : offset + part.numel()].view(weights[i].shape).to(weights[i].device)
            offset += part.numel()


def _applied_masks(
    module: nn.Module, targets: list, weights: list[torch.Tensor], masks: list[torch.Tensor], method_name: str
) -> PruningReport:
    """Store each mask (shared by every holder of a tied weight), zero the pruned weights, and report."""
    report = PruningReport(method_name, 0.0)
    owners = parameter_owners(module)
    for (fqn, sub, pname), weight, mask in zip(targets, weights, masks, strict=True):
        shared = set_mask(owners.get(id(weight)) or [(fqn, sub, pname)], mask)
        weight.mul_(shared)
        pruned = int(mask.numel() - mask.sum())
        report.per_tensor[mask_key(fqn, pname)] = pruned / max(mask.numel(), 1)
        report.num_pruned += pruned
        report.num_prunable += mask.numel()
        report.mask_bytes += shared.nbytes
    report.sparsity = report.num_pruned / max(report.num_prunable, 1)
    return report
