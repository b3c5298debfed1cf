"""The oldest version of each dependency the compatibility legs test, and the one check against it.

``pyproject.toml``'s lower bounds are these (``tests/test_versions.py`` keeps them equal); README's
Compatibility section and ``docs/compatibility.md`` say which leg ran each. A feature calls
:func:`require` before it touches the dependency, so an older install gets one ``ImportError`` naming the
version found, the oldest tested and the command that fixes it, never a traceback from deep inside (a fake
tensor's, a missing torchao class's).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from types import ModuleType

TESTED_FLOORS: dict[str, tuple[int, ...]] = {
    "torch": (2, 11),
    "lightning": (2, 5),
    "torchmetrics": (1, 4),
    "jsonargparse": (4, 51),
    "torchao": (0, 18),
    "transformers": (4, 57),
}
"""Distribution -> the oldest (major, minor) a compatibility leg ran (``make test-compat COMPAT=floors`` /
``COMPAT=torch-2.11`` / ``COMPAT=transformers-4``)."""


def parse_version(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``.

    Example::

        >>> parse_version("4.57.6"), parse_version("2.13.0+cpu"), parse_version("0.13.0rc1")
        ((4, 57, 6), (2, 13, 0), (0, 13, 0))
    """
    match = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def require(distribution: str, feature: str) -> None:
    """Raise when ``distribution`` is older than :data:`TESTED_FLOORS` says; nothing when it is not installed
    (the feature's own import reports that, with its install hint).

    Args:
        distribution: a key of :data:`TESTED_FLOORS`, e.g. ``"transformers"``.
        feature: what needs it, for the message (``"quantization"``).

    Raises:
        ImportError: the installed version is below the tested floor.

    Example::

        >>> require("torch", "the memory core")  # torch 2.13 here: nothing to say
    """
    floor = TESTED_FLOORS[distribution]
    version = installed_version(distribution)
    if version is None or parse_version(version)[: len(floor)] >= floor:
        return
    wanted = ".".join(map(str, floor))
    raise ImportError(
        f"{feature} needs {distribution} >= {wanted}; {distribution} {version} is installed. lightning_lowmem is "
        f"tested from {distribution} {wanted} on (see docs/compatibility.md): pip install '{distribution}>={wanted}'"
    )


def optional_import(module: str, feature: str, extra: str | None = None, distribution: str | None = None) -> ModuleType:
    """Import ``module`` for ``feature``, or raise one ``ImportError`` that says what to install; then check the
    installed version against :data:`TESTED_FLOORS` (:func:`require`). The one helper for every optional
    dependency (torch-pruning, zstandard / lz4, scikit-learn, matplotlib, transformers, torchao).

    Args:
        module: the module to import, e.g. ``"torch_pruning"`` or ``"lz4.frame"``.
        feature: what needs it, for the message (``"structural pruning"``).
        extra: the package extra that installs it (``pip install 'lightning-lowmem[extra]'``). Default: ``None``.
        distribution: the pip name. Default: ``None`` (the top-level module's name).

    Returns:
        The imported module.

    Raises:
        ImportError: not installed (with the install command), or older than the tested floor.

    Example::

        >>> optional_import("json", "reading configs").__name__
        'json'
        >>> optional_import("no_such_module", "the feature", extra="hf", distribution="no-such")
        Traceback (most recent call last):
        ...
        ImportError: the feature needs no-such: pip install 'lightning-lowmem[hf]' (or pip install no-such)
    """
    distribution = distribution or module.split(".")[0]
    try:
        imported = importlib.import_module(module)
    except ImportError as err:
        install = (
            f"pip install 'lightning-lowmem[{extra}]' (or pip install {distribution})"
            if extra
            else f"pip install {distribution}"
        )
        raise ImportError(f"{feature} needs {distribution}: {install}") from err
    if distribution in TESTED_FLOORS:
        require(distribution, feature)
    return imported
