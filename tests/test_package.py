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


def test_a_submodule_imported_before_torch_still_registers_the_checkpoint_loader():
    """`import lightning_lowmem.memory.measure` first: torch finishes importing inside it, and the after-import
    hook must not import the half-initialised module back (it did through an eager package namespace)."""
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import lightning_lowmem.memory.measure, torch\n"
        "from lightning_lowmem.functional.quantization.serialization import rebuild_quantized_tensor\n"
        "print(rebuild_quantized_tensor in torch.serialization.get_safe_globals())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-1500:]
    assert out.stdout.strip() == "True"
