"""Declared lower bounds = the tested floors; an older install gets one clear error at the feature."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from lightning_lowmem import _versions

ROOT = Path(__file__).resolve().parents[1]


def declared_floors() -> dict[str, tuple[int, ...]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["hf"]
    floors = {}
    for requirement in requirements:
        match = re.match(r"([A-Za-z0-9_-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9.]+)", requirement)
        if match:
            floors[match.group(1)] = _versions.parse_version(match.group(2))
    return floors


def test_pyproject_lower_bounds_are_the_tested_floors():
    declared = declared_floors()
    for distribution, floor in _versions.TESTED_FLOORS.items():
        assert declared[distribution] == floor, distribution


def test_an_older_version_is_one_clear_error_naming_it_and_the_fix(monkeypatch):
    monkeypatch.setattr(_versions, "installed_version", lambda name: "4.40.2" if name == "transformers" else None)
    with pytest.raises(
        ImportError,
        match=r"^Hugging Face models needs transformers >= 4\.57; transformers 4\.40\.2 is "
        r"installed\..*pip install 'transformers>=4\.57'$",
    ):
        from lightning_lowmem.models.hf import _transformers

        _transformers()
    _versions.require("torchao", "quantization")  # not installed (as faked): the feature's own import says so


def test_estimate_memory_checks_transformers_on_a_hugging_face_model(monkeypatch):
    hf_zoo = pytest.importorskip("tests.hf_zoo")
    import torch

    from lightning_lowmem import estimate_memory

    module = hf_zoo.hf_module("llama")
    monkeypatch.setattr(_versions, "installed_version", lambda name: "4.39.0")
    with pytest.raises(ImportError, match=r"estimate_memory on a Hugging Face model needs transformers >= 4\.57"):
        estimate_memory(module, {"input_ids": torch.zeros(1, 8, dtype=torch.long)}, device="cpu")
