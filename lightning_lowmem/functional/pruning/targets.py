"""Which parameters a pruning run prunes, and the lottery-ticket rewind of those parameters.

:func:`resolve_targets` turns ``ModelPruning``'s ``parameters_to_prune`` / ``parameter_names`` into
``(fqn, module, parameter name)`` triples of the model *as it is now* (modules swapped by another
transform since are found again by name, explicit pairs by their parameter); :func:`snapshot` and
:func:`rewind_` keep and restore the unpruned weights (Frankle & Carbin's lottery ticket).
"""

from __future__ import annotations

import copy
import difflib
import warnings
import weakref
from typing import Any, Sequence

import torch
from torch import nn

from lightning_lowmem.functional.pruning.masks import (
    collect_prunable,
    embedding_parameters,
    get_mask,
    head_modules,
    head_parameters,
    mask_key,
)
from lightning_lowmem.warnings import LowMemWarning

__all__ = ["Target", "describe_targets", "resolve_targets", "rewind_", "snapshot", "warn_head_targets"]

#: ``(qualified module name, module, parameter name)``
Target = tuple[str, nn.Module, str]


def resolve_targets(
    module: nn.Module,
    parameters_to_prune: Sequence[Any] = (),
    parameter_names: Sequence[str] = ("weight", "bias"),
    *,
    names_given: bool = True,
    structural: bool = False,
    embeddings: bool = False,
    heads: bool = False,
) -> list[Target]:
    """The parameters to prune in ``module`` as it is now, one triple per parameter (a tied weight once).

    Args:
        module: the model.
        parameters_to_prune: ``(module, "weight")`` pairs or ``"module.fqn.param"`` strings; empty = every
            module's ``parameter_names`` (embeddings only with ``embeddings``). Default: ``()``.
        parameter_names: names pruned in each module when ``parameters_to_prune`` is empty.
            Default: ``("weight", "bias")``.
        names_given: the user chose ``parameter_names``: a name no module has is an error (the default
            ``("weight", "bias")`` fits bias-free models). Default: ``True``.
        structural: with no ``parameters_to_prune``, only the layers structural removal can cut.
            Default: ``False``.
        embeddings: also embedding tables and the parameters tied to them. Default: ``False``.
        heads: also the task heads (:func:`~lightning_lowmem.functional.pruning.masks.head_modules`: poolers,
            classifiers, LM heads, the output layer). Default: ``False``.

    Raises:
        ValueError: a string entry naming no submodule, or a given parameter name no module has.

    Warns:
        LowMemWarning: an entry of ``parameters_to_prune`` is a task head or the output layer.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> [(fqn, name) for fqn, _, name in resolve_targets(model, ["0.weight"])]
        [('0', 'weight')]
    """
    pairs = []
    for item in parameters_to_prune:
        if isinstance(item, str):  # "fqn.param" from YAML
            fqn, _, pname = item.rpartition(".")
            try:
                pairs.append((module.get_submodule(fqn), pname))
            except AttributeError:
                names = [n for n, _ in module.named_parameters()]
                close = difflib.get_close_matches(item, names, n=5, cutoff=0.5) or names[:5]
                raise ValueError(
                    f"`parameters_to_prune` entry {item!r} names no submodule of {type(module).__name__}; "
                    f"entries are 'module.path.param' strings such as {close}"
                ) from None
        else:
            pairs.append(tuple(item))
    names = list(parameter_names)
    if not pairs and structural:  # mask only the channels structural removal can cut
        from lightning_lowmem.functional.pruning.structural import default_candidates

        pairs = [(layer, "weight") for _, layer in default_candidates(module)]
    if not pairs:  # ModelPruning prunes only the names each module has; error if a name exists nowhere
        present = {n.rsplit(".", 1)[-1] for n, _ in module.named_parameters()}
        missing = [n for n in names if n not in present]
        if missing and names_given:
            raise ValueError(
                f"`parameter_names` contains {missing}, which no module has; parameter names present: {sorted(present)}"
            )
        names = [n for n in names if n in present]
    targets = collect_prunable(module, names, None, pairs or None, embeddings=embeddings, heads=heads)
    if pairs:
        warn_head_targets(module, targets)
    return targets


#: the head targets already warned about, per model (a callback resolves its targets at every pruning event)
_WARNED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def warn_head_targets(module: nn.Module, targets: Sequence[Target]) -> list[str]:
    """Warn (``LowMemWarning``, once per model and head) when ``targets`` include a task head or the output
    layer; their names."""
    heads = head_parameters(module)
    named = [mask_key(fqn, pname) for fqn, sub, pname in targets if id(getattr(sub, pname)) in heads]
    warned = _WARNED.setdefault(module, set())
    if set(named) - warned:
        warned.update(named)
        warnings.warn(
            f"pruning {named[:4]}{' ...' if len(named) > 4 else ''}: the model's output layer / task head. Every "
            "weight of a head carries the prediction, and global magnitude pruning strips it first (50% global L1 "
            "zeroed 86% of a BERT classifier); leave it out of `parameters_to_prune` unless that is the point",
            LowMemWarning,
            stacklevel=3,
        )
    return named


def describe_targets(module: nn.Module, targets: Sequence[Target], *, embeddings: bool, heads: bool) -> str:
    """One line: how many tensors / weights are pruned, and what the defaults left out (embeddings, heads).

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> describe_targets(model, resolve_targets(model, parameter_names=["weight"]), embeddings=False, heads=False)
        'prunes 1 tensors (16 weights) in 1 modules: 0.weight; left out: heads 2 (prune_heads=True includes them)'
    """
    names = [mask_key(fqn, pname) for fqn, _, pname in targets]
    weights = sum(getattr(sub, pname).numel() for _, sub, pname in targets)
    shown = ", ".join(names[:6]) + (f", ... ({len(names) - 6} more)" if len(names) > 6 else "")
    line = (
        f"prunes {len(names)} tensors ({weights:,} weights) in {len({fqn for fqn, _, _ in targets})} modules: {shown}"
    )
    left = []
    if not embeddings and embedding_parameters(module):
        left.append(f"{len(embedding_parameters(module))} embedding tables (prune_embeddings=True includes them)")
    if not heads and head_modules(module):
        left.append(f"heads {', '.join(head_modules(module))} (prune_heads=True includes them)")
    return line + (f"; left out: {'; '.join(left)}" if left else "")


def snapshot(targets: Sequence[Target]) -> dict[str, torch.Tensor]:
    """A copy of each target's current values, keyed ``"fqn.param"`` (what :func:`rewind_` restores)."""
    return {f"{fqn}.{pname}": getattr(sub, pname).detach().clone() for fqn, sub, pname in targets}


@torch.no_grad()
def rewind_(targets: Sequence[Target], original: dict[str, torch.Tensor], resample: bool = False) -> None:
    """Rewind every target to its :func:`snapshot` value (``resample``: to a fresh ``reset_parameters()``
    value instead), then zero its pruned entries again.

    Example::

        >>> layer = nn.Linear(3, 3)
        >>> saved = snapshot([("", layer, "weight")])
        >>> _ = layer.weight.data.add_(1.0)
        >>> rewind_([("", layer, "weight")], saved)
        >>> torch.equal(layer.weight, saved[".weight"])
        True
    """
    for fqn, sub, pname in targets:
        weight = getattr(sub, pname)
        if resample and hasattr(sub, "reset_parameters"):
            fresh = copy.deepcopy(sub)
            fresh.reset_parameters()
            weight.copy_(getattr(fresh, pname))
        else:
            weight.copy_(original[f"{fqn}.{pname}"])
        mask = get_mask(sub, pname)
        if mask is not None:
            weight.mul_(mask)
