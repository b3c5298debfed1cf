"""Make ``import lightning_lowmem`` allowlist the package's checkpoint rebuild function for
``torch.load(weights_only=True)`` without importing torch itself (``import lightning_lowmem`` stays fast).

The function (:func:`lightning_lowmem.functional.quantization_serialization.rebuild_quantized_tensor`) must be
in torch's safe globals before a quantized checkpoint is loaded, which can only happen once torch is
imported: if it already is, register now; otherwise a one-shot import hook registers right after ``torch``
finishes importing (the same pattern as ``strategies/_registration.py`` uses for Lightning).
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from typing import Any

_WATCHED = "torch"


def _register() -> None:
    from lightning_lowmem.functional.quantization_serialization import register_safe_globals

    register_safe_globals()


class _RegisterAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of ``torch`` so registration follows it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _WATCHED:
            return None
        sys.meta_path.remove(self)  # one shot; also lets the real finders answer below
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                exec_module = spec.loader.exec_module

                def exec_then_register(module: Any) -> None:
                    exec_module(module)
                    try:
                        _register()
                    except Exception as err:  # noqa: BLE001 - never break `import torch` itself
                        warnings.warn(f"lightning_lowmem could not register its checkpoint loader: {err!r}", stacklevel=2)

                spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
                return spec
        return None


def register_on_torch_import() -> None:
    """Allowlist the rebuild function now if torch is loaded, else as soon as it is."""
    if _WATCHED in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegisterAfterTorch) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterTorch())
