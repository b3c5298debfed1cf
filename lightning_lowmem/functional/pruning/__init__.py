"""Pruning: unstructured / N:M masks (``unstructured``, with the mask bookkeeping in ``masks``), physical
removal of channels and heads through Torch-Pruning's dependency graph (``structural``), and the packed
sparse checkpoint format (``sparse_format``).
"""

from lightning_lowmem.functional.pruning.masks import layer_sparsity, remove_pruning_, sparsity
from lightning_lowmem.functional.pruning.sparse_format import from_sparse_state_dict, to_sparse_state_dict
from lightning_lowmem.functional.pruning.structural import StructuralPruningReport, prune_structural_, restore_shapes_
from lightning_lowmem.functional.pruning.unstructured import METHODS, PruningReport, prune_

__all__ = [
    "METHODS",
    "PruningReport",
    "StructuralPruningReport",
    "from_sparse_state_dict",
    "layer_sparsity",
    "prune_",
    "prune_structural_",
    "remove_pruning_",
    "restore_shapes_",
    "sparsity",
    "to_sparse_state_dict",
]
