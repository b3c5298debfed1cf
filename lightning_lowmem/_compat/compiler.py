"""torch.compile, Inductor and FX: freezing, the eager stance, the vmap markers FX must keep.

Each function names the private name it uses (of torch, Lightning, transformers or torchao) and why no public
API does the job.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["force_eager", "inductor_freezing", "keep_vmap_nesting"]


class inductor_freezing:  # noqa: N801 - used like a function: ``with inductor_freezing(): ...``
    """A context in which ``torch.compile`` treats parameters as constants (Inductor "freezing").

    Freezing lets Inductor pre-pack weights and fuse pt2e int8 patterns into oneDNN ``qlinear`` kernels
    on x86 CPUs; without it a quantized graph runs its reference dequantize/quantize ops.

    Why private: freezing is only switchable through ``torch._inductor.config.freezing``, and dynamo reads
    it while tracing (to inline parameters as constants), so ``torch.compile(options={"freezing": True})``,
    which reaches Inductor only, fails on pt2e int8 graphs (``onednn.qlinear_prepack`` has no fake kernel).
    Setting and restoring the attribute costs about 10 us a call; ``config.patch`` about 85 us.
    """

    def __enter__(self) -> None:
        import torch._inductor.config as inductor_config

        self._previous = inductor_config.freezing
        inductor_config.freezing = True

    def __exit__(self, *exc_info: Any) -> None:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = self._previous


def keep_vmap_nesting() -> None:
    """Make FX dead-code elimination keep functorch's vmap level markers, from now on (idempotent).

    Why private: transformers 4.x builds attention masks under ``torch.vmap``; ``torch.export`` records that as
    ``_vmap_increment_nesting`` / ``_vmap_decrement_nesting`` calls whose results nothing reads. They change
    functorch's nesting level (a side effect), but FX does not know it: torchao's ``convert_pt2e``, and the
    ``.eval()`` / ``.train()`` of an exported model, delete them as dead code, leaving ``_add_batch_dim`` calls
    that fail at run time ("tensor may have escaped from inside a function being vmapped").
    ``torch.fx.node._side_effectful_functions`` is the set ``Node.is_impure`` consults; adding the two markers
    for good (not only while converting: Lightning calls ``.eval()`` on the installed graph later) is the fix.
    """
    try:
        import torch.fx.node as fx_node
        from torch._functorch import predispatch
    except ImportError:  # pragma: no cover - a torch without pre-dispatch vmap
        return
    fx_node._side_effectful_functions.update({predispatch._vmap_increment_nesting, predispatch._vmap_decrement_nesting})


def force_eager() -> Any:
    """A context in which ``torch.compile``-d functions run their Python code eagerly.

    Needed wherever tensors are fake or a dispatch mode is tracking: a compiled kernel called with fake
    tensors reads memory that does not exist (torchao's low-bit optimizers compile their per-parameter
    step), and compiled frames hide their allocations from a ``TorchDispatchMode``.
    """
    import contextlib

    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    if set_stance is None:
        return contextlib.nullcontext()
    return set_stance("force_eager")
