"""The package's public surface: every lazily exported name resolves, and the import stays light."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import lightning_lowmem


def test_every_public_name_resolves():
    for name in lightning_lowmem.__all__:
        assert getattr(lightning_lowmem, name) is not None, name


def test_every_callback_module_exports_its_class_and_type_checkers_see_every_export():
    """callbacks/<snake_name>.py defines the callback <SnakeName> (found by file, exported from the package and from
    lightning_lowmem.callbacks), and the root's ``TYPE_CHECKING`` block imports every export (the real types)."""
    import ast
    import inspect
    from pathlib import Path

    import lightning as L

    import lightning_lowmem.callbacks as callbacks

    for name in callbacks.__all__:
        value = getattr(callbacks, name)
        assert inspect.isclass(value) and issubclass(value, L.Callback) and value.__name__ == name, name
        assert getattr(lightning_lowmem, name) is value
    tree = ast.parse(Path(lightning_lowmem.__file__).read_text())
    typed = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for inner in node.body
        if isinstance(inner, ast.ImportFrom)
        for alias in inner.names
    }
    assert sorted(set(lightning_lowmem.__all__) - {"__version__"} - typed) == []


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


NOISE = ("Could not load this library", "register_constant() on Enum subclasses is deprecated")


def _stderr(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-1500:]
    return out.stderr


def test_the_python_api_prints_no_torchao_import_lines():
    """The first quantize_ imports torchao: without the package's filters that prints a `Failed to load
    .../torchao/_C_mxfp8...so` line per CUDA-only kernel and torch's enum deprecation (as `import torchao` alone
    still does here); after `import lightning_lowmem`, nothing (issue #26 item 13)."""
    import torch

    plain = _stderr("import torchao.quantization")
    if not any(line in plain for line in NOISE):
        pytest.skip("this torch / torchao logs nothing at import")
    code = (
        "import torch, lightning_lowmem\n"
        "from lightning_lowmem.functional import quantize_\n"
        "report = quantize_(torch.nn.Sequential(torch.nn.Linear(64, 64)), 'int8_weight_only')\n"
        "assert report.converted == ['0'], report"
    )
    quiet = _stderr(code)
    kept = () if not torch.cuda.is_available() else ("Could not load this library",)  # kept where CUDA runs
    assert not [line for line in NOISE if line in quiet and line not in kept], quiet


def test_the_filters_drop_only_those_lines_and_keep_a_kernel_failure_where_cuda_runs(caplog, monkeypatch):
    import torch

    from lightning_lowmem._quiet import quiet_startup_logs

    quiet_startup_logs()
    kernel = "Failed to load /x/site-packages/torchao/_C_mxfp8.abi3.so: Could not load this library: /x/_C_mxfp8.so"
    with caplog.at_level(logging.WARNING):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        logging.getLogger("torchao").warning(kernel)  # dropped on a CPU machine
        logging.getLogger("torchao").warning("Failed to load config.json")  # a real problem: kept
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        logging.getLogger("torchao").warning(kernel)  # kept where CUDA runs: the kernel is missing there
    assert [r.getMessage() for r in caplog.records] == ["Failed to load config.json", kernel]
