"""The embedded workloads load without downloads and train."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem.demo import CharLM, CharLMDataModule, DigitsClassifier, DigitsDataModule, GPTConfig
from lightning_lowmem.models.corpus import stdlib_files


def test_charlm_corpus_excludes_tests_and_is_deterministic():
    files = stdlib_files()
    assert files and not any("/test/" in f.as_posix() for f in files)
    a, b = CharLMDataModule(max_chars=5000), CharLMDataModule(max_chars=5000)
    assert a.fingerprint == b.fingerprint


def test_charlm_include_selects_a_part():
    email = CharLMDataModule(max_chars=5000, include=["email/*"])
    json_ = CharLMDataModule(max_chars=5000, include=["json/*"])
    assert email.fingerprint != json_.fingerprint
    with pytest.raises(ValueError, match="no stdlib .py file matches"):
        CharLMDataModule(include=["no_such_package/*"]).setup()


def test_digits_split_sizes():
    dm = DigitsDataModule()
    dm.setup()
    sizes = [len(dm._splits[s]) for s in ("train", "val", "test")]
    assert sum(sizes) == 1797 and sizes[1] == sizes[2] == int(1797 * 0.15)


def test_models_shapes_and_bad_input():
    assert CharLM(n_layer=1, n_embd=32, n_head=2, block_size=8)(torch.zeros(2, 8, dtype=torch.long)).shape == (
        2,
        8,
        256,
    )
    assert DigitsClassifier(arch="cnn", hidden=8)(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    with pytest.raises(ValueError, match=r"`n_embd`=30 must be divisible by `n_head`=4"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match=r"`arch`='rnn' is unknown"):
        DigitsClassifier(arch="rnn")
    with pytest.raises(ValueError, match="`val_fraction` must be in"):
        CharLMDataModule(val_fraction=1.5)


def test_the_hf_wrappers_old_paths_name_the_models_module():
    """`lightning_lowmem.demo.HFLanguageModel` (README) and the module path `lightning_lowmem.demo.hf` (YAML
    `class_path`) still name the wrappers that moved to `lightning_lowmem.models.hf`."""
    import importlib

    from lightning_lowmem import demo
    from lightning_lowmem.models import hf

    assert demo.HFLanguageModel is hf.HFLanguageModel and demo.HFTextDataModule is hf.HFTextDataModule
    assert importlib.import_module("lightning_lowmem.demo.hf") is hf
    from lightning_lowmem.demo.hf import build_hf_model

    assert build_hf_model is hf.build_hf_model
