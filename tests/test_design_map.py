"""``docs/design.md``'s module map is the package as it is: every module appears in it, every module it names exists.

The map is generated: after adding, renaming or removing a module, run ``python tests/test_design_map.py`` and
paste its output over the block under "## Module map" in docs/design.md.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_lowmem"
DESIGN = ROOT / "docs" / "design.md"
WIDTH = 116


def package_modules() -> dict[str, list[str]]:
    """``{folder relative to the package ("" for its root): sorted module names}``, ``__init__`` left out."""
    folders: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        folder = path.parent.relative_to(PACKAGE).as_posix()
        folders.setdefault("" if folder == "." else folder + "/", [])
        if path.stem != "__init__":
            folders["" if folder == "." else folder + "/"].append(path.stem)
    return {folder: sorted(names) for folder, names in sorted(folders.items())}


def render() -> str:
    """The module map block: one entry per folder, its modules wrapped under it."""
    lines = []
    for folder, names in package_modules().items():
        head = (folder or "lightning_lowmem/").ljust(28)
        body = textwrap.wrap(" ".join(names) or "(only __init__)", WIDTH - 28)
        lines.append(head + body[0])
        lines += [" " * 28 + rest for rest in body[1:]]
    return "\n".join(lines)


def documented_map() -> str:
    text = DESIGN.read_text()
    match = re.search(r"## Module map\n.*?```text\n(.*?)\n```", text, flags=re.S)
    assert match, "docs/design.md has no '## Module map' section with a ```text block"
    return match.group(1)


def documented_modules() -> set[str]:
    found, folder = set(), None
    for line in documented_map().splitlines():
        if not line.startswith(" "):
            folder, _, line = line.partition(" ")
            folder = "" if folder == "lightning_lowmem/" else folder
        found.update(folder + name for name in line.split() if name != "(only" and name != "__init__)")
    return found


def test_every_module_is_in_the_map_and_every_mapped_module_exists():
    real = {folder + name for folder, names in package_modules().items() for name in names}
    mapped = documented_modules()
    assert sorted(real - mapped) == [], "modules missing from docs/design.md's map (python tests/test_design_map.py)"
    assert sorted(mapped - real) == [], "docs/design.md's map names modules that do not exist"


def test_the_map_is_the_generated_one():
    assert documented_map() == render(), "regenerate docs/design.md's module map: python tests/test_design_map.py"


def test_the_prose_names_no_missing_module():
    """Paths written out in the prose (``functional/pruning/arguments.py``) exist too."""
    named = set(re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)`", DESIGN.read_text()))
    missing = sorted(path for path in named if not (PACKAGE / path).exists() and not (PACKAGE.parent / path).exists())
    assert missing == []


if __name__ == "__main__":
    print(render())
