"""The per-layer bookkeeping of a pruning run in `functional/pruning/bookkeeping.py`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.pruning import prune_
from lightning_lowmem.functional.pruning.bookkeeping import restore_masks_, sparsity_lines, sync_masks_, target_masks
from lightning_lowmem.functional.pruning.masks import get_mask


def _pruned(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    prune_(model, 0.5, "l1_unstructured", parameters_to_prune=[(model[0], "weight"), (model[1], "weight")])
    return model


def test_target_masks_then_restore_reproduces_zeros_in_a_fresh_model():
    model = _pruned(0)
    masks = target_masks([("0", model[0], "weight"), ("1", model[1], "weight")])
    assert sorted(masks) == ["0.weight", "1.weight"]
    assert sum(int((~mask).sum()) for mask in masks.values()) == (64 + 32) // 2
    fresh = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    restore_masks_(fresh, masks)
    assert torch.equal(fresh[0].weight == 0, ~masks["0.weight"])
    with pytest.raises(ValueError, match=r"masks for \['2.weight'\], which are not parameters of Sequential"):
        restore_masks_(fresh, {"2.weight": masks["0.weight"]})


def test_sync_masks_takes_the_broadcast_masks_and_applies_them():
    model, source = _pruned(0), _pruned(1)
    targets = [("0", model[0], "weight")]
    source_mask = get_mask(source[0], "weight").cpu()
    assert not torch.equal(get_mask(model[0], "weight"), source_mask)
    sync_masks_(model, targets, lambda mask: source_mask.clone())
    assert torch.equal(get_mask(model[0], "weight"), source_mask)
    assert bool((model[0].weight[~source_mask] == 0).all())  # applied (earlier zeros stay zero)
    assert int((model[0].weight == 0).sum()) > 32


def test_sparsity_lines_by_verbosity():
    layers = {"a.weight": 0.5, "b.weight": 0.25}
    assert sparsity_lines(0.4, layers, "nm", verbose=0) == []
    assert sparsity_lines(0.4, layers, "nm", verbose=1) == ["ScheduledPruning: total sparsity 40.00% (nm)"]
    assert sparsity_lines(0.4, layers, "nm", verbose=2)[1:] == ["  a.weight: 50.00%", "  b.weight: 25.00%"]
