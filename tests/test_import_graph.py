"""The package's import graph: no circles between files or packages, and the layers of docs/design.md.

Every import counts, including the lazy ones inside functions: a lazy import hides a circle from Python's
import machinery, not from the reader.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import lightning_lowmem

ROOT = Path(lightning_lowmem.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module (of the package or outside it) that ``name`` imports, at any depth of its code."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(base)
    return found - {name}


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


def _package(name: str) -> str:
    """``lightning_lowmem.functional.pruning.masks`` -> ``functional``; top-level modules name themselves."""
    return name.split(".")[1] if "." in name else "<root>"


def test_the_walk_sees_the_package():
    assert len(MODULES) > 80
    assert "lightning_lowmem.functional.pruning.masks" in IMPORTS["lightning_lowmem.functional.pruning.unstructured"]
    # a lazy import inside a function counts
    assert "lightning_lowmem.functional.optimizers.catalog" in IMPORTS["lightning_lowmem.planning._fake_step"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_circle_between_files():
    internal = {name: {t for t in targets if t in MODULES} for name, targets in IMPORTS.items()}
    assert _cycles(internal) == []


def test_no_circle_between_packages():
    """Between the package's sub-packages and top-level modules; the root ``__init__`` (the lazy public
    namespace, which names everything) is left out."""
    edges: dict[str, set[str]] = {}
    for name, targets in IMPORTS.items():
        if name == "lightning_lowmem":
            continue
        for target in targets:
            if target in MODULES and target != "lightning_lowmem" and _package(target) != _package(name):
                edges.setdefault(_package(name), set()).add(_package(target))
    assert _cycles(edges) == []


def test_memory_only_counts():
    """``memory/`` imports nothing that applies a technique (``functional/``), plans or trains."""
    forbidden = ("functional", "planning", "callbacks", "strategies", "plugins", "checkpoints", "distillation", "demo")
    arrows = sorted(
        f"{name} -> {target}"
        for name, targets in IMPORTS.items()
        if _package(name) == "memory"
        for target in targets
        if target in MODULES and _package(target) in forbidden
    )
    assert arrows == []


def test_functional_and_memory_never_import_lightning():
    arrows = sorted(
        f"{name} -> {target}"
        for name, targets in IMPORTS.items()
        if _package(name) in ("functional", "memory")
        for target in targets
        if target.split(".")[0] in ("lightning", "pytorch_lightning")
    )
    assert arrows == []


_PRIVATE_ROOTS = ("torch", "lightning", "lightning_fabric", "pytorch_lightning")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(path: Path) -> list[str]:
    """Private torch / Lightning names a file imports (``from torch.utils._pytree import ...``,
    ``from lightning.fabric.utilities.types import _PATH``) or reaches as ``torch._C`` / ``torch.x._y``
    (``torch.ops.aten._foo`` names an operator, not a private module: allowed)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
            found += [
                f"import {n}"
                for n in names
                if n.split(".")[0] in _PRIVATE_ROOTS and any(map(_is_private, n.split(".")))
            ]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _PRIVATE_ROOTS:
            names = [alias.name for alias in node.names]
            if any(map(_is_private, node.module.split("."))) or any(map(_is_private, names)):
                found.append(f"from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            chain.reverse()
            if (
                isinstance(value, ast.Name)
                and value.id == "torch"
                and chain[0] != "ops"
                and any(map(_is_private, chain))
            ):
                found.append("torch." + ".".join(chain))
    return sorted(set(found))


def test_private_torch_and_lightning_only_through_compat(tmp_path):
    """The ``_compat`` package (one module per wrapped library / area) is the one place that touches private
    torch / Lightning names (docs/design.md); in particular no ``torch.testing._internal`` (test code) in the
    package."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nfrom torch.utils._pytree import tree_map\nfrom lightning.fabric.utilities.types import _PATH\n"
        "torch._C._current_graph_task_id()\ntorch.ops.aten._local_scalar_dense.default\n"
    )
    assert len(_private_uses(sample)) == 4  # the checker sees each kind (the aten op is allowed)
    uses = [
        f"{name}: {use}"
        for name, path in MODULES.items()
        if name != "lightning_lowmem._compat" and not name.startswith("lightning_lowmem._compat.")
        for use in _private_uses(path)
    ]
    assert uses == []


def test_no_module_imports_another_modules_underscore_names():
    """A name another module needs is public in its module (a private *module*, ``memory/_tracker.py``, may
    hold public names: the underscore on the module says "not for users")."""
    found = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_lowmem"):
                for alias in node.names:
                    if _is_private(alias.name) and f"{node.module}.{alias.name}" not in MODULES:
                        found.add(f"{name}: {node.module}.{alias.name}")
    assert sorted(found) == []


_FIRST_IMPORTS = """
import importlib, importlib.abc, sys, torch

class NoLightning(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "lightning" or fullname.startswith("lightning."):
            raise ImportError("lightning is held back in this pass")

def import_fresh(name):
    for loaded in [m for m in sys.modules if m == "lightning_lowmem" or m.startswith("lightning_lowmem.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as err:
        return f"{type(err).__name__}: {err}"

failed, later, hold = [], [], NoLightning()
sys.meta_path.insert(0, hold)
for name in NAMES:
    error = import_fresh(name)
    if error and "held back" in error:
        later.append(name)
    elif error:
        failed.append(f"{name}: {error}")
sys.meta_path.remove(hold)
for name in later:
    error = import_fresh(name)
    if error:
        failed.append(f"{name}: {error}")
print("\\n".join(failed))
"""


def test_every_module_imports_first():
    """Each module imported first, in a fresh ``lightning_lowmem`` (torch already loaded): a package ``__init__`` that
    imports a module which imports it back half-way fails here even when the file graph has no circle. A first
    pass holds Lightning back (once it is loaded, the package registers its strategies on import, which imports
    ``functional`` in another order and would hide such a failure); the modules that need Lightning go second."""
    names = sorted(name for name in MODULES if not name.endswith("__main__"))
    script = f"NAMES = {names!r}\n" + _FIRST_IMPORTS
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == ""
