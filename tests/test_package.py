"""The package's public surface: every lazily exported name resolves, and the import stays light."""

from __future__ import annotations

import subprocess
import sys

import lightning_lowmem


def test_every_public_name_resolves():
    for name in lightning_lowmem.__all__:
        assert getattr(lightning_lowmem, name) is not None, name


def test_import_does_not_load_torchao_or_lightning():
    code = "import sys, lightning_lowmem; print(sorted(m for m in ('torchao', 'lightning', 'torch_pruning') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
