"""The one place where lightning_lowmem touches private torch / Lightning attributes, split by what it wraps.

Each function says which private name it uses and why no public API does the job. When torch (or Lightning,
transformers, torchao) grows a public equivalent, only its module here changes:

- ``autograd``: which backward runs, the order of post-accumulate-grad hooks, saved-tensor hooks, views;
- ``fake_mode``: fake tensors and dispatch modes (the estimator's fake step and its value questions);
- ``compiler``: ``torch.compile`` / Inductor / FX (freezing, the eager stance, vmap markers);
- ``cuda_memory``: the CUDA allocator's memory-snapshot tool;
- ``dispatcher``: dispatch keys an op skips, a ``torch.library`` kernel set removed now;
- ``distributed``: FSDP2's storage resizes and collectives, the fake process group;
- ``lightning_internals``: Lightning's private helpers (model-parallel setup, sharded checkpoints, launcher);
- ``hf_masks``: ``transformers``' mask decisions on a fake padding mask;
- ``torchao_optim``: torchao's low-bit optimizer state.
"""

from __future__ import annotations

# Private torch names the package uses in several places, re-exported here: import them from ``_compat``.
# ``import torch`` loads all three modules already, so re-exporting them costs nothing.
# - FakeTensor: the class behind ``fake_mode.fake_tensor_mode`` (``torch._subclasses``; see there).
# - TorchDispatchMode: the documented ``__torch_dispatch__`` extension point (the memory tracker, the
#   estimator's value questions) is importable only from ``torch.utils._python_dispatch``.
# - pytree: torch's nested-container utilities (``torch.utils._pytree``) have no public module; torch.compile,
#   torch.export and FSDP use the same functions on the same containers.
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

__all__ = ["FakeTensor", "TorchDispatchMode", "tree_flatten", "tree_leaves", "tree_map", "tree_unflatten"]
