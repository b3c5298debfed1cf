"""Pruning: unstructured / N:M masks (``unstructured``, with the mask bookkeeping in ``masks``), physical
removal of channels and heads through Torch-Pruning's dependency graph (``structural``), and the packed
sparse checkpoint format (``sparse_format``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_lowmem._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "METHODS": "lightning_lowmem.functional.pruning.unstructured",
    "PruningReport": "lightning_lowmem.functional.pruning.unstructured",
    "StructuralPruningReport": "lightning_lowmem.functional.pruning.structural",
    "from_sparse_state_dict": "lightning_lowmem.functional.pruning.sparse_format",
    "layer_sparsity": "lightning_lowmem.functional.pruning.masks",
    "prune_": "lightning_lowmem.functional.pruning.unstructured",
    "prune_structural_": "lightning_lowmem.functional.pruning.structural",
    "remove_pruning_": "lightning_lowmem.functional.pruning.masks",
    "restore_shapes_": "lightning_lowmem.functional.pruning.structural",
    "sparsity": "lightning_lowmem.functional.pruning.masks",
    "to_sparse_state_dict": "lightning_lowmem.functional.pruning.sparse_format",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what the lazy exports resolve to, for IDEs and type checkers
    from lightning_lowmem.functional.pruning.masks import layer_sparsity, remove_pruning_, sparsity
    from lightning_lowmem.functional.pruning.sparse_format import from_sparse_state_dict, to_sparse_state_dict
    from lightning_lowmem.functional.pruning.structural import (
        StructuralPruningReport,
        prune_structural_,
        restore_shapes_,
    )
    from lightning_lowmem.functional.pruning.unstructured import METHODS, PruningReport, prune_
