"""Make ``import lightning_lowmem`` register the strategy names without importing Lightning itself.

Importing ``lightning.pytorch`` takes seconds; ``import lightning_lowmem`` takes milliseconds. The
names must be in Lightning's ``StrategyRegistry`` before ``Trainer(strategy="lowmem")`` looks them
up, which can only happen once ``lightning.pytorch`` is imported. So: if it already is, register now;
otherwise a one-shot import hook registers right after ``lightning.pytorch`` finishes importing.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from typing import Any

_WATCHED = "lightning.pytorch"


def _register() -> None:
    import lightning_lowmem.strategies.fsdp  # noqa: F401  (registers "lowmem_fsdp" on import)
    import lightning_lowmem.strategies.low_memory  # noqa: F401  (registers on import)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of ``lightning.pytorch`` so registration follows it."""

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
                    except Exception as err:  # noqa: BLE001 - never break `import lightning` itself
                        warnings.warn(f"lightning_lowmem could not register its strategies: {err!r}", stacklevel=2)

                spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
                return spec
        return None


def register_on_lightning_import() -> None:
    """Register ``"lowmem"`` / ``"lowmem_ddp"`` / ``"lowmem_ddp_spawn"`` / ``"lowmem_fsdp"`` now or when Lightning loads."""
    if _WATCHED in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
