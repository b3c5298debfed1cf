"""The per-layer bookkeeping of a pruning run, pure (no Trainer): the masks a checkpoint saves and puts back,
the masks every process is made to share, and the sparsity lines a run reports."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from lightning_lowmem.functional.pruning.masks import apply_masks_, get_mask, load_masks_
from lightning_lowmem.functional.pruning.targets import Target

__all__ = ["restore_masks_", "sparsity_lines", "sync_masks_", "target_masks"]


def target_masks(targets: Sequence[Target]) -> dict[str, torch.Tensor]:
    """The masks of ``targets`` on CPU, keyed ``"fqn.param"`` (one entry per target: a tied weight once).

    Example::

        >>> from lightning_lowmem.functional.pruning import prune_
        >>> layer = nn.Linear(4, 2)
        >>> _ = prune_(layer, 0.5, "l1_unstructured", parameters_to_prune=[(layer, "weight")])
        >>> {key: int(mask.sum()) for key, mask in target_masks([("", layer, "weight")]).items()}
        {'weight': 4}
    """
    masks = {}
    for fqn, sub, pname in targets:
        mask = get_mask(sub, pname)
        if mask is not None:
            masks[f"{fqn}.{pname}" if fqn else pname] = mask.detach().cpu().clone()
    return masks


def restore_masks_(module: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """Put the masks saved by :func:`target_masks` back into ``module`` and apply them.

    Raises:
        ValueError: a saved mask names no parameter of ``module`` (a different model or callbacks).
    """
    missing = load_masks_(module, masks)
    if missing:
        raise ValueError(
            f"the checkpoint holds ScheduledPruning masks for {missing[:5]}, which are not parameters of "
            f"{type(module).__name__}: resume with the model (and callbacks) the checkpoint was written with"
        )


def sync_masks_(
    module: nn.Module, targets: Sequence[Target], broadcast: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Give every process the masks of the source process: ``broadcast`` takes a CPU mask and returns the
    source's (e.g. ``lambda t: trainer.strategy.broadcast(t, src=0)``); the masks are then applied."""
    for _, sub, pname in targets:
        mask = get_mask(sub, pname)
        mask.copy_(broadcast(mask.cpu()).to(mask.device))
    apply_masks_(module)


def sparsity_lines(total: float, layers: dict[str, float], method: object, verbose: int) -> list[str]:
    """What a pruning event reports: nothing (``verbose=0``), the total sparsity (1), and each layer's (2).

    Example::

        >>> sparsity_lines(0.5, {"fc.weight": 0.75}, "l1_unstructured", verbose=2)
        ['ScheduledPruning: total sparsity 50.00% (l1_unstructured)', '  fc.weight: 75.00%']
    """
    lines = [f"ScheduledPruning: total sparsity {total:.2%} ({method})"] if verbose else []
    if verbose == 2:
        lines.extend(f"  {name}: {value:.2%}" for name, value in layers.items())
    return lines
