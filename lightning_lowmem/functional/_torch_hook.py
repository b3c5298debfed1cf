"""Make ``import lightning_lowmem`` allowlist the package's checkpoint rebuild function for
``torch.load(weights_only=True)`` without importing torch itself (``import lightning_lowmem`` stays fast).

The function (:func:`lightning_lowmem.functional.quantization.serialization.rebuild_quantized_tensor`) must be
in torch's safe globals before a quantized checkpoint is loaded, which can only happen once torch is
imported: if it already is, register now; otherwise a one-shot import hook registers right after ``torch``
finishes importing (:mod:`lightning_lowmem._after_import`, as for Lightning's strategy names).
"""

from __future__ import annotations

from lightning_lowmem._after_import import call_after_import


def _register() -> None:
    from lightning_lowmem.functional.quantization.serialization import register_safe_globals

    register_safe_globals()


def register_on_torch_import() -> None:
    """Allowlist the rebuild function now if torch is loaded, else as soon as it is."""
    call_after_import("torch", _register, "checkpoint loader")
