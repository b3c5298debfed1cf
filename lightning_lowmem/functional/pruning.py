"""Mask-based pruning on a plain ``nn.Module``: masks are ``bool`` buffers, weights are zeroed in place.

Unlike ``torch.nn.utils.prune`` there is no ``weight_orig`` copy and no float mask: each pruned
parameter ``<name>`` gets one non-persistent ``bool`` buffer ``<name>_mask`` (1 byte per weight) on its
module, and :func:`apply_masks_` multiplies the weight by it in place (call it after every optimizer
step). Masks only ever grow: a weight pruned once stays pruned.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, Union

import torch
from torch import nn

from lightning_lowmem.warnings import NoEffectWarning

__all__ = [
    "METHODS",
    "PruningReport",
    "apply_masks_",
    "collect_prunable",
    "from_sparse_state_dict",
    "get_mask",
    "layer_sparsity",
    "prune_",
    "remove_pruning_",
    "sparsity",
    "to_sparse_state_dict",
]

METHODS = ("l1_unstructured", "random_unstructured", "ln_structured", "random_structured", "nm")
MASK_SUFFIX = "_mask"
Amount = Union[int, float]
FilterFn = Callable[[nn.Module, str], bool]


@dataclass
class PruningReport:
    """What :func:`prune_` did: ``sparsity`` over the pruned tensors and per tensor (by ``module.param`` name)."""

    method: str
    sparsity: float
    per_tensor: dict[str, float] = field(default_factory=dict)
    num_pruned: int = 0
    num_prunable: int = 0


def _is_transposed(module: nn.Module) -> bool:
    # HF's Conv1D (GPT-2) stores weight as (in_features, out_features)
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def weight_dims(module: nn.Module, name: str = "weight") -> tuple[int, int]:
    """Return ``(output_dim, input_dim)`` of ``module.<name>``: (0, 1) for Linear/Conv, (1, 0) for HF Conv1D."""
    if name == "weight" and _is_transposed(module):
        return 1, 0
    return 0, 1


def get_mask(module: nn.Module, name: str = "weight") -> torch.Tensor | None:
    """The ``bool`` mask buffer of ``module.<name>``, or ``None`` when it is not pruned."""
    mask = getattr(module, name + MASK_SUFFIX, None)
    return mask if isinstance(mask, torch.Tensor) else None


def _set_mask(module: nn.Module, name: str, mask: torch.Tensor) -> None:
    existing = get_mask(module, name)
    if existing is None:
        # non-persistent: the model's state_dict stays loadable into an unpruned model
        module.register_buffer(name + MASK_SUFFIX, mask.to(torch.bool), persistent=False)
    else:
        existing.copy_(mask)


def collect_prunable(
    module: nn.Module,
    parameter_names: Sequence[str] = ("weight",),
    filter_fn: FilterFn | None = None,
    parameters_to_prune: Sequence[tuple[nn.Module, str]] | None = None,
) -> list[tuple[str, nn.Module, str]]:
    """List ``(fqn, submodule, parameter_name)`` targets.

    With ``parameters_to_prune`` those pairs are used as given; otherwise every leaf module (no children)
    owning a parameter in ``parameter_names`` and accepted by ``filter_fn(module, fqn)``.

    Raises:
        ValueError: a name in ``parameter_names`` (or a pair of ``parameters_to_prune``) that no module has.
    """
    names = {id(m): n for n, m in module.named_modules()}
    targets: list[tuple[str, nn.Module, str]] = []
    if parameters_to_prune:
        for pair in parameters_to_prune:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], nn.Module)):
                raise TypeError(f"`parameters_to_prune` entries must be (nn.Module, 'param_name') pairs, got {pair!r}")
            sub, pname = pair
            if not isinstance(getattr(sub, pname, None), nn.Parameter):
                have = [n for n, _ in sub.named_parameters(recurse=False)]
                raise ValueError(
                    f"`parameters_to_prune` names parameter {pname!r} of {type(sub).__name__}, which has"
                    f" parameters {have}"
                )
            targets.append((names.get(id(sub), type(sub).__name__), sub, pname))
        return targets
    found: set[str] = set()
    for fqn, sub in module.named_modules():
        if any(True for _ in sub.children()):
            continue
        if filter_fn is not None and not filter_fn(sub, fqn):
            continue
        for pname in parameter_names:
            if isinstance(getattr(sub, pname, None), nn.Parameter):
                targets.append((fqn, sub, pname))
                found.add(pname)
    missing = [p for p in parameter_names if p not in found]
    if missing:
        available = sorted({n.rsplit(".", 1)[-1] for n, _ in module.named_parameters()})
        raise ValueError(
            f"`parameter_names` contains {missing}, which no (filtered) module has; parameter names present: {available}"
        )
    return targets


def _check_amount(amount: Any) -> None:
    if isinstance(amount, bool) or not isinstance(amount, (int, float)):
        raise TypeError(f"`amount`={amount!r} must be a float in [0, 1] or an int >= 0, got {type(amount).__name__}")
    if isinstance(amount, int) and amount < 0:
        raise ValueError(f"`amount`={amount} must be >= 0 when an int (an absolute number of weights to prune)")
    if isinstance(amount, float) and not 0.0 <= amount <= 1.0:
        raise ValueError(f"`amount`={amount} must be in [0, 1] when a float (a fraction of the weights to prune)")


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


def _validate(method: Any, n: int, m: int, dim: int | None, norm: float) -> None:
    if isinstance(method, str) and method not in METHODS:
        raise ValueError(f"`method`={method!r} is unknown; choose one of {list(METHODS)}")
    if method == "nm":
        if not (isinstance(n, int) and isinstance(m, int)) or n < 1 or m < 2 or n >= m:
            raise ValueError(f"N:M pruning needs ints 1 <= n < m, got n={n!r}, m={m!r} (e.g. n=2, m=4)")
    if dim is not None and not isinstance(dim, int):
        raise TypeError(f"`dim`={dim!r} must be an int or None (None: the output-channel dim of each module)")
    if not isinstance(norm, (int, float)) or norm <= 0:
        raise ValueError(f"`norm`={norm!r} must be a number > 0 (e.g. 1 or 2; float('inf') allowed)")


@torch.no_grad()
def prune_(
    module: nn.Module,
    target_sparsity: Amount,
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
) -> PruningReport:
    """Compute ``bool`` masks reaching ``target_sparsity`` and zero the pruned weights, in place.

    Args:
        module: the model to prune.
        target_sparsity: float in [0, 1] = fraction of weights (structured: of channels) pruned after the
            call; int = that number of weights (channels) per tensor, or in total when ``global_``.
            Ignored by ``"nm"``, whose sparsity is ``1 - n/m``.
        method: one of :data:`METHODS`, or a ``torch.nn.utils.prune.BasePruningMethod`` subclass
            (local only; its float mask is turned into a bool one). Default: ``"l1_unstructured"``.
        global_: rank weights (or channels, by norm per element) across all targets. Default: ``False``.
        parameter_names: parameter names to prune in each leaf module. Default: ``("weight",)``.
        filter_fn: ``filter_fn(module, fqn) -> bool`` chooses modules. Default: ``None`` (all).
        parameters_to_prune: explicit ``(module, name)`` pairs; overrides the two above. Default: ``None``.
        n, m: keep ``n`` of every ``m`` consecutive weights along the input dim (``"nm"``). Default: 2, 4.
        dim: dim whose slices structured methods prune. Default: ``None`` = each module's output dim.
        norm: the ``p`` of the norm ranking channels in ``ln_structured``. Default: 1.
        relative: ``amount`` applies to the still-unpruned weights (``torch.nn.utils.prune``'s iterative
            meaning, used for ``ModelPruning`` compatibility). Default: ``False``.
        generator: random generator for the random methods. Default: ``None`` (global RNG).

    Returns:
        A :class:`PruningReport`.

    Raises:
        ValueError: unknown method, bad ``amount``, ``n >= m``, a parameter name no module has.
        TypeError: ``target_sparsity`` / ``dim`` of the wrong type.

    Example::

        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> prune_(model, 0.75, global_=True).sparsity
        0.75
    """
    _validate(method, n, m, dim, norm)
    if method != "nm":
        _check_amount(target_sparsity)
    targets = collect_prunable(module, parameter_names, filter_fn, parameters_to_prune)
    if not targets:
        warnings.warn("prune_ matched no parameter: nothing was pruned", NoEffectWarning, stacklevel=2)
        return PruningReport(str(method), 0.0)
    masks = {}
    for fqn, sub, pname in targets:
        weight = getattr(sub, pname)
        current = get_mask(sub, pname)
        masks[(fqn, pname)] = torch.ones_like(weight, dtype=torch.bool) if current is None else current.clone()
    method_name = method if isinstance(method, str) else getattr(method, "__name__", str(method))
    structured = method in ("ln_structured", "random_structured")
    random = method in ("random_unstructured", "random_structured")

    if not isinstance(method, str):  # a torch BasePruningMethod subclass
        if global_:
            raise ValueError(f"`method`={method_name} (a custom pruning method) only supports local pruning (global_=False)")
        for fqn, sub, pname in targets:
            weight, key = getattr(sub, pname), (fqn, pname)
            kwargs = {"dim": dim if dim is not None else 0} if getattr(method, "PRUNING_TYPE", "") == "structured" else {}
            pruner = method(target_sparsity, **kwargs)
            masks[key] &= pruner.compute_mask(weight.detach(), default_mask=masks[key].to(weight.dtype)).bool()
    elif method == "nm":
        for fqn, sub, pname in targets:
            weight = getattr(sub, pname)
            nm = _nm_mask(weight, masks[(fqn, pname)], weight_dims(sub, pname)[1] if weight.dim() > 1 else 0, n, m)
            if nm is None:
                message = f"{fqn}.{pname} {tuple(weight.shape)}: input dim not divisible by m={m}; left unpruned"
                warnings.warn(message, NoEffectWarning, stacklevel=2)
                continue
            masks[(fqn, pname)] = nm
    elif structured:
        scores, sizes = [], []
        for fqn, sub, pname in targets:
            weight = getattr(sub, pname)
            d = (dim if dim is not None else weight_dims(sub, pname)[0]) % max(weight.dim(), 1)
            s = _channel_scores(weight, masks[(fqn, pname)], d, norm, random, generator)
            if global_:  # compare channels of different sizes by norm per element
                s = s / (weight.numel() // weight.shape[d]) ** (1.0 / norm)
            scores.append((s, d))
            sizes.append(s.numel())
        groups = [list(range(len(targets)))] if global_ else [[i] for i in range(len(targets))]
        for group in groups:
            flat = torch.cat([scores[i][0].cpu() for i in group])
            k = _num_to_prune(target_sparsity, flat.numel(), int(torch.isinf(flat).sum()), relative)
            drop = torch.zeros(flat.numel(), dtype=torch.bool)
            drop[torch.topk(flat, k, largest=False).indices] = True
            offset = 0
            for i in group:
                fqn, sub, pname = targets[i]
                weight, (s, d) = getattr(sub, pname), scores[i]
                keep = ~drop[offset : offset + s.numel()].to(weight.device)
                offset += s.numel()
                masks[(fqn, pname)] &= _expand_channels(keep, weight.shape, d)
    else:  # unstructured magnitude / random
        groups = [list(range(len(targets)))] if global_ else [[i] for i in range(len(targets))]
        for group in groups:
            parts = []
            for i in group:
                fqn, sub, pname = targets[i]
                weight, mask = getattr(sub, pname), masks[(fqn, pname)]
                score = torch.rand(weight.shape, generator=generator) if random else weight.detach().abs().float().cpu()
                parts.append(score.flatten().masked_fill(~mask.flatten().cpu(), float("-inf")))
            flat = torch.cat(parts)
            k = _num_to_prune(target_sparsity, flat.numel(), int(torch.isinf(flat).sum()), relative)
            drop = torch.zeros(flat.numel(), dtype=torch.bool)
            drop[torch.topk(flat, k, largest=False, sorted=False).indices] = True
            offset = 0
            for i, part in zip(group, parts):
                fqn, sub, pname = targets[i]
                weight = getattr(sub, pname)
                masks[(fqn, pname)] &= ~drop[offset : offset + part.numel()].view(weight.shape).to(weight.device)
                offset += part.numel()

    report = PruningReport(method_name, 0.0)
    for fqn, sub, pname in targets:
        mask = masks[(fqn, pname)]
        _set_mask(sub, pname, mask)
        getattr(sub, pname).mul_(mask)
        pruned = int(mask.numel() - mask.sum())
        report.per_tensor[f"{fqn}.{pname}" if fqn else pname] = pruned / max(mask.numel(), 1)
        report.num_pruned += pruned
        report.num_prunable += mask.numel()
    report.sparsity = report.num_pruned / max(report.num_prunable, 1)
    return report


def _masked(module: nn.Module) -> Iterable[tuple[str, nn.Module, str, torch.Tensor]]:
    for fqn, sub in module.named_modules():
        for bname, buf in list(sub.named_buffers(recurse=False)):
            if bname.endswith(MASK_SUFFIX) and buf.dtype == torch.bool:
                pname = bname[: -len(MASK_SUFFIX)]
                if isinstance(getattr(sub, pname, None), torch.Tensor):
                    yield fqn, sub, pname, buf


@torch.no_grad()
def apply_masks_(module: nn.Module) -> int:
    """Zero every pruned weight in place (call after each optimizer step). Returns the number of masked tensors.

    Example::

        >>> model = nn.Linear(4, 4)
        >>> _ = prune_(model, 0.5)
        >>> _ = model.weight.data.fill_(1.0)
        >>> apply_masks_(model), int((model.weight == 0).sum())
        (1, 8)
    """
    count = 0
    for _, sub, pname, mask in _masked(module):
        getattr(sub, pname).mul_(mask)
        count += 1
    return count


@torch.no_grad()
def remove_pruning_(module: nn.Module) -> int:
    """Make pruning permanent: zero pruned weights and delete the mask buffers (plain parameters remain).

    Returns:
        The number of masks removed.
    """
    removed = 0
    for _, sub, pname, mask in list(_masked(module)):
        getattr(sub, pname).mul_(mask)
        delattr(sub, pname + MASK_SUFFIX)
        removed += 1
    return removed


def layer_sparsity(module: nn.Module) -> dict[str, float]:
    """Fraction of zeros of each masked tensor (or, without masks, of each leaf module's ``weight``)."""
    result = {
        f"{fqn}.{pname}" if fqn else pname: float((getattr(sub, pname) == 0).float().mean())
        for fqn, sub, pname, _ in _masked(module)
    }
    if result:
        return result
    return {
        f"{fqn}.weight" if fqn else "weight": float((sub.weight == 0).float().mean())
        for fqn, sub in module.named_modules()
        if isinstance(getattr(sub, "weight", None), nn.Parameter) and sub.weight.dim() > 1
    }


def sparsity(module: nn.Module) -> float:
    """Fraction of zeros over the masked tensors (or, without masks, over every >=2-D ``weight``).

    Example::

        >>> model = nn.Linear(10, 10)
        >>> _ = prune_(model, 0.3)
        >>> sparsity(model)
        0.3
    """
    zeros = total = 0
    found = False
    for _, sub, pname, _mask in _masked(module):
        tensor = getattr(sub, pname)
        zeros, total, found = zeros + int((tensor == 0).sum()), total + tensor.numel(), True
    if not found:
        for sub in module.modules():
            weight = getattr(sub, "weight", None)
            if isinstance(weight, nn.Parameter) and weight.dim() > 1:
                zeros, total = zeros + int((weight == 0).sum()), total + weight.numel()
    return zeros / total if total else 0.0


_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def to_sparse_state_dict(state_dict: dict[str, torch.Tensor], min_sparsity: float = 0.5) -> dict[str, Any]:
    """Pack tensors with at least ``min_sparsity`` zeros as bitmask + non-zero values (loads with ``weights_only=True``).

    Each packed entry becomes ``{"shape": [...], "bitmask": uint8 (numel/8 bytes), "values": 1-D tensor}``.

    Example::

        >>> sd = {"w": torch.tensor([[0.0, 2.0], [0.0, 0.0]])}
        >>> torch.equal(from_sparse_state_dict(to_sparse_state_dict(sd))["w"], sd["w"])
        True
    """
    packed: dict[str, Any] = {}
    for key, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.numel() < 8:
            packed[key] = tensor
            continue
        nonzero = (tensor != 0).flatten().cpu()
        if 1.0 - float(nonzero.float().mean()) < min_sparsity:
            packed[key] = tensor
            continue
        bits = torch.nn.functional.pad(nonzero.to(torch.uint8), (0, (-nonzero.numel()) % 8)).view(-1, 8)
        bitmask = (bits * _BIT_WEIGHTS).sum(dim=1).to(torch.uint8)  # (ceil(numel/8),)
        packed[key] = {"shape": list(tensor.shape), "bitmask": bitmask, "values": tensor.flatten().cpu()[nonzero].clone()}
    return packed


def from_sparse_state_dict(packed: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_sparse_state_dict`."""
    state_dict: dict[str, torch.Tensor] = {}
    for key, value in packed.items():
        if isinstance(value, dict) and {"shape", "bitmask", "values"} <= value.keys():
            numel = 1
            for size in value["shape"]:
                numel *= size
            bits = (value["bitmask"].unsqueeze(1) & _BIT_WEIGHTS).ne(0).flatten()[:numel]
            dense = torch.zeros(numel, dtype=value["values"].dtype)
            dense[bits] = value["values"]
            state_dict[key] = dense.view(value["shape"])
        else:
            state_dict[key] = value
    return state_dict
