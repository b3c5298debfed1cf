"""Where pruning masks live and which parameters a pruning touches (no scoring here: see ``pruning.prune_``).

Each pruned parameter ``<name>`` has one non-persistent ``bool`` buffer ``<name>_mask`` on the module that
holds it (1 byte per weight). A parameter held by several modules (tied weights: GPT-2's ``lm_head.weight``
is ``transformer.wte.weight``) has **one** mask tensor, registered on every owner, and is counted once by
:func:`sparsity`, :func:`layer_sparsity`, :func:`mask_state` and :func:`apply_masks_`.

Which parameters by default (:func:`collect_prunable`): every module that directly holds a parameter named
in ``parameter_names`` (``nn.Linear``, Hugging Face ``Conv1D``, torchao ``FakeQuantizedLinear``, ...) except
embedding tables and the parameters tied to them, unless ``embeddings=True``, and except the task heads
(:func:`head_modules`: poolers, classifiers, LM heads, the output layer), unless ``heads=True``: every weight of a
head carries the prediction, so global magnitude pruning, whose threshold the hidden layers set, strips it first
(50% global L1 zeroed 99.95% of a BERT pooler and 86% of its classifier, issue #34).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from lightning_lowmem.functional.multihead_attention import MHA_WEIGHTS

__all__ = [
    "EMBEDDING_TYPES",
    "HEAD_NAMES",
    "MASK_SUFFIX",
    "apply_masks_",
    "collect_prunable",
    "embedding_parameters",
    "get_mask",
    "head_modules",
    "head_parameters",
    "layer_sparsity",
    "load_masks_",
    "mask_state",
    "parameter_owners",
    "remove_pruning_",
    "sparsity",
    "weight_dims",
]

MASK_SUFFIX = "_mask"
FilterFn = Callable[[nn.Module, str], bool]


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


Owner = tuple[str, nn.Module, str]  # (module fqn, module, parameter name)
EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


def parameter_owners(module: nn.Module) -> dict[int, list[Owner]]:
    """Every ``(fqn, submodule, name)`` holding each parameter directly, keyed by ``id(parameter)``.

    A tied parameter (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) has several owners, listed
    in ``named_modules`` order (the first is its canonical name).
    """
    owners: dict[int, list[Owner]] = {}
    for fqn, sub in module.named_modules():
        for pname, param in sub.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((fqn, sub, pname))
    return owners


def embedding_parameters(module: nn.Module) -> set[int]:
    """``id`` of every embedding table of ``module`` (so also of every parameter tied to one, e.g. a tied head)."""
    return {id(sub.weight) for sub in module.modules() if isinstance(sub, EMBEDDING_TYPES)}


#: a module with one of these names holds a task head (and everything under it): left out of default pruning
HEAD_NAMES = frozenset({"classifier", "pooler", "score", "lm_head", "head", "qa_outputs"})


def head_modules(module: nn.Module) -> list[str]:
    """Qualified names of ``module``'s task heads: every module named in :data:`HEAD_NAMES` (outermost only) and
    (when none is named) the output layer, the last module holding a weight matrix other than an embedding (when more
    than one does).

    Example::

        >>> head_modules(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
        ['2']
    """
    heads: list[str] = []
    layers = []
    for fqn, sub in module.named_modules():
        inside = any(fqn == head or fqn.startswith(head + ".") for head in heads)
        if not inside and fqn.rsplit(".", 1)[-1] in HEAD_NAMES:
            heads.append(fqn)
        if not isinstance(sub, EMBEDDING_TYPES) and any(p.dim() >= 2 for p in sub.parameters(recurse=False)):
            layers.append((fqn, inside or fqn in heads))
    if not heads and len(layers) > 1:  # no named head: the last layer is the output (LitGPT registers lm_head first)
        heads.append(layers[-1][0])
    return heads


def head_parameters(module: nn.Module) -> set[int]:
    """``id`` of every parameter of :func:`head_modules` (all of a named head's, the output layer's own)."""
    found: set[int] = set()
    named = {fqn for fqn, _ in module.named_modules() if fqn.rsplit(".", 1)[-1] in HEAD_NAMES}
    for fqn in head_modules(module):
        found.update(id(p) for p in module.get_submodule(fqn).parameters(recurse=fqn in named))
    return found


def mask_key(fqn: str, pname: str) -> str:
    return f"{fqn}.{pname}" if fqn else pname


def set_mask(owners: Sequence[Owner], mask: torch.Tensor) -> torch.Tensor:
    """Store ``mask`` as the ``bool`` buffer of the parameter on every owner: one tensor, shared by tied owners."""
    _, first, pname = owners[0]
    shared = get_mask(first, pname)
    if shared is None:
        shared = mask.to(torch.bool).clone()
    else:
        shared.copy_(mask)
    for _, sub, name in owners:
        if get_mask(sub, name) is not shared:
            # non-persistent: the model's state_dict stays loadable into an unpruned model
            sub.register_buffer(name + MASK_SUFFIX, shared, persistent=False)
    return shared


def _module_names(module: nn.Module, owners: dict[int, list[Owner]], pname: str) -> list[str]:
    return [mask_key(o[0], o[2]) for found in owners.values() for o in found if o[2] == pname] or [
        n for n, _ in module.named_parameters()
    ]


def collect_prunable(
    module: nn.Module,
    parameter_names: Sequence[str] = ("weight",),
    filter_fn: FilterFn | None = None,
    parameters_to_prune: Sequence[tuple[nn.Module, str]] | None = None,
    *,
    embeddings: bool = False,
    heads: bool = False,
) -> list[Owner]:
    """List ``(fqn, submodule, parameter_name)`` targets, one per distinct parameter.

    With ``parameters_to_prune`` those pairs are used as given (embeddings included when named). A pair
    whose module was since replaced in ``module`` (e.g. swapped for a fake-quantized layer holding the same
    parameter) is found again by its parameter. Otherwise: every module that directly holds a parameter
    in ``parameter_names`` (``"weight"`` includes an ``nn.MultiheadAttention``'s ``in_proj_weight``) and is accepted by ``filter_fn(module, fqn)``, embeddings (and parameters tied
    to them) only when ``embeddings``, the task heads (:func:`head_modules`) only when ``heads``. A tied parameter
    appears once, under its first owner's name.

    Raises:
        ValueError: a name in ``parameter_names`` that no module has, or a ``parameters_to_prune`` pair that
            is not a parameter of ``module``.
        TypeError: a ``parameters_to_prune`` entry that is not a ``(module, name)`` pair.
    """
    owners = parameter_owners(module)
    seen: set[int] = set()
    targets: list[Owner] = []
    if parameters_to_prune:
        for pair in parameters_to_prune:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], nn.Module)):
                raise TypeError(f"`parameters_to_prune` entries must be (nn.Module, 'param_name') pairs, got {pair!r}")
            sub, pname = pair
            param = getattr(sub, pname, None)
            if not isinstance(param, nn.Parameter):
                have = [n for n, _ in sub.named_parameters(recurse=False)]
                raise ValueError(
                    f"`parameters_to_prune` names parameter {pname!r} of {type(sub).__name__}, which has"
                    f" parameters {have}"
                )
            found = owners.get(id(param))
            if not found:
                raise ValueError(
                    f"`parameters_to_prune` entry ({type(sub).__name__}, {pname!r}) is not a parameter of the "
                    f"{type(module).__name__} being pruned; pass modules of that model (its {pname!r} parameters: "
                    f"{_module_names(module, owners, pname)[:8]})"
                )
            if id(param) not in seen:
                seen.add(id(param))
                targets.append(next((o for o in found if o[1] is sub), found[0]))
        return targets
    skip = set() if embeddings else embedding_parameters(module)
    skip |= set() if heads else head_parameters(module)
    found_names: set[str] = set()
    for fqn, sub in module.named_modules():
        if filter_fn is not None and not filter_fn(sub, fqn):
            continue
        own = dict(sub.named_parameters(recurse=False))
        for pname in _names_in(sub, parameter_names):
            param = own.get(pname)
            if not isinstance(param, nn.Parameter):
                continue
            found_names.add(pname)
            if id(param) in skip or id(param) in seen:
                continue
            seen.add(id(param))
            targets.append((fqn, sub, pname))
    missing = [p for p in parameter_names if p not in found_names]
    if missing:
        available = sorted({n.rsplit(".", 1)[-1] for n, _ in module.named_parameters()})
        raise ValueError(
            f"`parameter_names` contains {missing}, which no (filtered) module has; parameter names present: {available}"
        )
    return targets


def _names_in(sub: nn.Module, parameter_names: Sequence[str]) -> list[str]:
    """``parameter_names`` as ``sub`` holds them: an ``nn.MultiheadAttention``'s ``"weight"`` is its
    ``in_proj_weight`` (or ``q`` / ``k`` / ``v_proj_weight``), which its functional forward reads, masks included."""
    if "weight" in parameter_names and isinstance(sub, nn.MultiheadAttention):
        return [*parameter_names, *MHA_WEIGHTS]
    return list(parameter_names)


def _masked(module: nn.Module, unique: bool = True) -> Iterable[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(fqn, module, param, mask)`` of every mask buffer; ``unique``: a tied parameter once (its first owner)."""
    seen: set[int] = set()
    for fqn, sub in module.named_modules():
        for bname, buf in list(sub.named_buffers(recurse=False)):
            if bname.endswith(MASK_SUFFIX) and buf.dtype == torch.bool:
                pname = bname[: -len(MASK_SUFFIX)]
                param = getattr(sub, pname, None)
                if isinstance(param, torch.Tensor) and not (unique and id(param) in seen):
                    seen.add(id(param))
                    yield fqn, sub, pname, buf


@torch.no_grad()
def apply_masks_(module: nn.Module) -> int:
    """Zero every pruned weight in place (call after each optimizer step). Returns the number of masked tensors.

    Example::

        >>> model = nn.Linear(4, 4)
        >>> _ = load_masks_(model, {"weight": torch.arange(16).view(4, 4) % 2 == 0})
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
        The number of masks removed (a mask shared by tied owners counts once).
    """
    removed = apply_masks_(module)
    for _, sub, pname, _mask in list(_masked(module, unique=False)):
        delattr(sub, pname + MASK_SUFFIX)
    return removed


def mask_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every mask of ``module`` on CPU, keyed ``"fqn.param"`` (a tied parameter once, under its first owner)."""
    return {mask_key(fqn, pname): mask.detach().cpu().clone() for fqn, sub, pname, mask in _masked(module)}


@torch.no_grad()
def load_masks_(module: nn.Module, masks: dict[str, torch.Tensor]) -> list[str]:
    """Put masks saved by :func:`mask_state` back (shared again by tied owners) and apply them.

    Returns:
        The keys of ``masks`` that name no parameter of ``module``.
    """
    owners = parameter_owners(module)
    by_name = {mask_key(fqn, pname): found for found in owners.values() for fqn, _, pname in found}
    missing = []
    for key, mask in masks.items():
        found = by_name.get(key)
        if found is None:
            missing.append(key)
            continue
        param = getattr(found[0][1], found[0][2])
        set_mask(owners[id(param)], mask.to(device=param.device, dtype=torch.bool))
    apply_masks_(module)
    return missing


def layer_sparsity(module: nn.Module) -> dict[str, float]:
    """Fraction of zeros of each masked tensor (or, without masks, of each leaf module's ``weight``)."""
    result = {
        mask_key(fqn, pname): float((getattr(sub, pname) == 0).float().mean()) for fqn, sub, pname, _ in _masked(module)
    }
    if result:
        return result
    return {
        mask_key(fqn, "weight"): float((sub.weight == 0).float().mean())
        for fqn, sub in module.named_modules()
        if isinstance(getattr(sub, "weight", None), nn.Parameter) and sub.weight.dim() > 1
    }


def sparsity(module: nn.Module, embeddings: bool = False) -> float:
    """Fraction of zeros over the masked tensors (or, without masks, over every >=2-D ``weight``).

    Each parameter counts once (a tied weight once). Without masks, embedding tables (and weights tied to
    them) count only when ``embeddings`` (default ``False``, like :func:`prune_`'s default targets).

    Example::

        >>> model = nn.Linear(10, 10)
        >>> _ = load_masks_(model, {"weight": torch.arange(100).view(10, 10) >= 30})
        >>> sparsity(model)
        0.3
    """
    zeros = total = 0
    found = False
    for _, sub, pname, _mask in _masked(module):
        tensor = getattr(sub, pname)
        zeros, total, found = zeros + int((tensor == 0).sum()), total + tensor.numel(), True
    if not found:
        skip = set() if embeddings else embedding_parameters(module)
        for sub in module.modules():
            for name in _names_in(sub, ["weight"]):
                weight = getattr(sub, name, None)
                if isinstance(weight, nn.Parameter) and weight.dim() > 1 and id(weight) not in skip:
                    skip.add(id(weight))
                    zeros, total = zeros + int((weight == 0).sum()), total + weight.numel()
    return zeros / total if total else 0.0
