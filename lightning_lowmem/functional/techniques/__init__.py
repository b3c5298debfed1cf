"""Techniques that live in one module each: the module defines the technique's config, its handler (registered with
:func:`~lightning_lowmem.functional.registry.register_technique` when the module is imported) and its functional
entry points; the built-ins that predate this folder are in :mod:`lightning_lowmem.functional.handlers`.

Importing this package fills the registry: the built-ins first (``describe()`` order), then every public module of
this folder, found by :mod:`pkgutil`, not listed (:class:`~lightning_lowmem.functional.config.TrainingConfig`'s
module imports it): adding a technique here is adding its file.
"""

from __future__ import annotations

import importlib
import pkgutil

import lightning_lowmem.functional.handlers  # noqa: F401  (the built-ins register first)

__all__ = ["technique_modules"]


def technique_modules() -> list[str]:
    """The qualified names of this folder's technique modules (its public ``.py`` files), sorted."""
    return sorted(
        f"{__name__}.{found.name}" for found in pkgutil.iter_modules(__path__) if not found.name.startswith("_")
    )


for _name in technique_modules():  # each registers its technique on import
    importlib.import_module(_name)
