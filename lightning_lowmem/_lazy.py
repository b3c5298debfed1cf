"""One lazy-export helper for the package namespaces (``lightning_lowmem``, ``lightning_lowmem.functional``).

A namespace maps each public name to the module that defines it and imports that module on first use, so
``import lightning_lowmem`` takes milliseconds and optional dependencies (torchao, torch-pruning, scikit-learn)
load only with the feature that needs them. Each namespace also imports the same names under
``typing.TYPE_CHECKING``, so IDEs and mypy see the real types.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path
from typing import Any, Callable


def lazy_exports(namespace: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module-level ``__getattr__`` and ``__dir__`` for ``namespace`` that import ``exports[name]`` on first use.

    Args:
        namespace: the package's ``__name__`` (for the error message).
        exports: public name -> module that defines it.

    Returns:
        ``(__getattr__, __dir__)``; the first caches each value in the namespace's globals.

    Example::

        >>> getattr_, dir_ = lazy_exports("demo", {"sqrt": "math"})
        >>> getattr_("sqrt")(4.0), dir_()
        (2.0, ['sqrt'])
    """
    names = sorted(exports)

    def __getattr__(name: str) -> Any:
        module_name = exports.get(name)
        if module_name is None:
            raise AttributeError(f"module {namespace!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name), name)
        package = sys.modules.get(namespace)
        if package is not None:  # the next access skips __getattr__
            setattr(package, name, value)
        return value

    def __dir__() -> list[str]:
        return list(names)

    return __getattr__, __dir__


def class_exports(package: str, folder: Path) -> dict[str, str]:
    """``{ClassName: module}`` for a folder of one-class modules, found by file (nothing imported): each public module
    ``snake_name.py`` of ``folder`` defines the class ``SnakeName`` (the callbacks: ``memory_monitor.py`` ->
    ``MemoryMonitor``).

    Args:
        package: the folder's package name, e.g. ``"lightning_lowmem.callbacks"``.
        folder: the folder.

    Example::

        >>> exports = class_exports("lightning_lowmem.callbacks", Path(__file__).parent / "callbacks")
        >>> exports["MemoryMonitor"]
        'lightning_lowmem.callbacks.memory_monitor'
    """
    found = (module.name for module in pkgutil.iter_modules([str(folder)]) if not module.name.startswith("_"))
    return {"".join(part.title() for part in name.split("_")): f"{package}.{name}" for name in sorted(found)}
