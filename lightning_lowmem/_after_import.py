"""Run a callback as soon as a module finishes importing, without importing it (``import lightning_lowmem``
stays fast). Used to register the strategy names once ``lightning.pytorch`` loads and the checkpoint rebuild
function once ``torch`` loads."""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from typing import Any, Callable


class _CallAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of ``name`` so ``callback`` follows its import."""

    def __init__(self, name: str, callback: Callable[[], None], what: str) -> None:
        self.name, self.callback, self.what = name, callback, what

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; also lets the real finders answer below
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                exec_module = spec.loader.exec_module

                def exec_then_call(module: Any, exec_module: Any = exec_module) -> None:
                    exec_module(module)
                    try:
                        self.callback()
                    except Exception as err:  # noqa: BLE001 - never break the import itself
                        warnings.warn(f"lightning_lowmem could not register its {self.what}: {err!r}", stacklevel=2)

                spec.loader.exec_module = exec_then_call  # type: ignore[method-assign]
                return spec
        return None


def call_after_import(name: str, callback: Callable[[], None], what: str) -> None:
    """``callback()`` now if module ``name`` is imported, else right after it finishes importing (once)."""
    if name in sys.modules:
        callback()
    elif not any(isinstance(f, _CallAfterImport) and f.name == name and f.callback is callback for f in sys.meta_path):
        sys.meta_path.insert(0, _CallAfterImport(name, callback, what))
