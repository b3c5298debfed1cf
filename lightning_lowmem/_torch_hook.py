"""Make ``import lightning_lowmem`` allowlist the package's checkpoint functions for
``torch.load(weights_only=True)`` without importing torch itself (``import lightning_lowmem`` stays fast).

- :func:`lightning_lowmem.functional.quantization.serialization.rebuild_quantized_tensor` rebuilds quantized
  tensors: a quantized checkpoint then loads with ``weights_only=True``.
- :func:`lightning_lowmem.checkpoints.file_format.written_by_CompressedCheckpointIO`, the first pickle of a
  compressed file, raises saying to load it with ``CompressedCheckpointIO`` or ``read_checkpoint``: a plain
  ``torch.load`` (a Trainer without the plugin) then says that in one line, instead of torch's refusal of an
  unknown global, which advises ``weights_only=False`` (that would not load the file either).

Both must be in torch's safe globals before a file is loaded, which can only happen once torch is imported: if it
already is, register now; otherwise a one-shot import hook registers right after ``torch`` finishes importing
(:mod:`lightning_lowmem._after_import`, as for Lightning's strategy names).
"""

from __future__ import annotations

from lightning_lowmem._after_import import call_after_import


def _register() -> None:
    from lightning_lowmem.checkpoints.file_format import register_prefix_safe_global
    from lightning_lowmem.functional.quantization.serialization import register_safe_globals

    register_safe_globals()
    register_prefix_safe_global()


def register_on_torch_import() -> None:
    """Allowlist the rebuild function now if torch is loaded, else as soon as it is."""
    call_after_import("torch", _register, "checkpoint loader")
