"""Every docstring example of the package runs: one doctest per module that has examples (``>>>``)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import lightning_lowmem

ROOT = Path(lightning_lowmem.__file__).parent


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        if ">>>" in path.read_text():
            parts = path.relative_to(ROOT.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def test_the_examples_are_found():
    assert len(MODULES) > 40
    assert "lightning_lowmem.functional.optimizers.catalog" in MODULES


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name):
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
