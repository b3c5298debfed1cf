"""``docs/design.md``'s module map is the package as it is: every module appears in it, every module it names exists.

The map is generated: after adding, renaming or removing a module, run ``python tests/test_design_map.py`` and
paste its output over the block under "## Module map" in docs/design.md. The folders whose modules are found by file
(``PATTERNS``: the callbacks, the technique modules) are named by their pattern, so adding one of those changes no
line of the map; a test checks each of their modules is what the pattern says.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_lowmem"
DESIGN = ROOT / "docs" / "design.md"
WIDTH = 116
#: folders whose public modules are found by file, named in the map by their pattern (after the private modules)
PATTERNS = {
    "callbacks/": "<callback>: one callback each, exported by its CamelCase name (memory_monitor -> MemoryMonitor)",
    "functional/techniques/": "<technique>: one technique each (its config, and its handler registered on import)",
}


def package_modules() -> dict[str, list[str]]:
    """``{folder relative to the package ("" for its root): sorted module names}``, ``__init__`` left out."""
    folders: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        folder = path.parent.relative_to(PACKAGE).as_posix()
        folders.setdefault("" if folder == "." else folder + "/", [])
        if path.stem != "__init__":
            folders["" if folder == "." else folder + "/"].append(path.stem)
    return {folder: sorted(names) for folder, names in sorted(folders.items())}


def mapped_modules() -> dict[str, list[str]]:
    """:func:`package_modules` with each pattern folder's public modules left to its pattern."""
    modules = package_modules()
    return {
        folder: [name for name in names if folder not in PATTERNS or name.startswith("_")]
        for folder, names in modules.items()
    }


def render() -> str:
    """The module map block: one entry per folder, its modules wrapped under it."""
    lines = []
    for folder, names in mapped_modules().items():
        head = (folder or "lightning_lowmem/").ljust(28)
        body = textwrap.wrap(" ".join([*names, PATTERNS.get(folder, "")]).strip() or "(only __init__)", WIDTH - 28)
        lines.append(head + body[0])
        lines += [" " * 28 + rest for rest in body[1:]]
    return "\n".join(lines)


def documented_map() -> str:
    text = DESIGN.read_text()
    match = re.search(r"## Module map\n.*?```text\n(.*?)\n```", text, flags=re.S)
    assert match, "docs/design.md has no '## Module map' section with a ```text block"
    return match.group(1)


def documented_modules() -> set[str]:
    found, folder, pattern = set(), None, False
    for line in documented_map().splitlines():
        if not line.startswith(" "):
            folder, _, line = line.partition(" ")
            folder, pattern = "" if folder == "lightning_lowmem/" else folder, False
        for name in line.split():
            pattern = pattern or name.startswith("<")  # the rest of the folder's entry describes its pattern
            if not pattern and name not in ("(only", "__init__)"):
                found.add(folder + name)
    return found


def test_every_module_is_in_the_map_and_every_mapped_module_exists():
    real = {folder + name for folder, names in mapped_modules().items() for name in names}
    mapped = documented_modules()
    assert sorted(real - mapped) == [], "modules missing from docs/design.md's map (python tests/test_design_map.py)"
    assert sorted(mapped - real) == [], "docs/design.md's map names modules that do not exist"


def test_every_module_of_a_pattern_folder_is_what_its_pattern_says():
    """A callbacks/ module exports its callback; a functional/techniques/ module is imported with the registry and
    registers a technique (its handler is defined there)."""
    import lightning_lowmem
    from lightning_lowmem.functional.registry import techniques
    from lightning_lowmem.functional.techniques import technique_modules

    modules = package_modules()
    for name in (name for name in modules["callbacks/"] if not name.startswith("_")):
        exported = "".join(part.title() for part in name.split("_"))
        assert getattr(lightning_lowmem, exported).__module__ == f"lightning_lowmem.callbacks.{name}", name
    public = [f"lightning_lowmem.functional.techniques.{n}" for n in modules.get("functional/techniques/", [])]
    public = [name for name in public if not name.rpartition(".")[2].startswith("_")]
    assert technique_modules() == public
    registering = {t.handler.__module__ for t in techniques()}
    assert [name for name in public if name not in registering] == []


def test_the_map_is_the_generated_one():
    assert documented_map() == render(), "regenerate docs/design.md's module map: python tests/test_design_map.py"


def test_the_prose_names_no_missing_module():
    """Paths written out in the prose (``functional/pruning/arguments.py``) exist too."""
    named = set(re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)`", DESIGN.read_text()))
    missing = sorted(path for path in named if not (PACKAGE / path).exists() and not (PACKAGE.parent / path).exists())
    assert missing == []


if __name__ == "__main__":
    print(render())
