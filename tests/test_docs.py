"""Every runnable Python block of ``docs/*.md`` runs as written (as ``tests/test_readme.py`` runs the README's).

A block is runnable unless the line just before its fence says why not: ``<!-- not run: a fragment: `model` is
yours -->`` (invisible on a rendered page). Training lengths are cut (``max_steps=N`` -> 2, ``max_epochs=N`` -> 1)
and each block runs in its own process, in a scratch folder, so files it writes land there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_RUN = re.compile(r"<!-- not run: .+ -->\n$")


def _blocks() -> list[tuple[str, str | None, str]]:
    """(``page:line``, why it is not run or ``None``, code) for every ``python`` block of ``docs/*.md``."""
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        for match in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
            before = text[: match.start()]
            previous = before[before.rstrip("\n").rfind("\n") + 1 :]
            skip = NOT_RUN.search(previous)
            line = before.count("\n") + 1
            found.append((f"{page.name}:{line}", skip.group(0).strip() if skip else None, match.group(1)))
    return found


BLOCKS = _blocks()


def _shortened(code: str) -> str:
    code = re.sub(r"max_steps=\d+", "max_steps=2", code)
    return re.sub(r"max_epochs=\d+", "max_epochs=1", code)


def test_every_page_block_is_either_run_or_says_why_not():
    assert len(BLOCKS) >= 20
    runnable = [where for where, skip, _ in BLOCKS if skip is None]
    assert len(runnable) >= 8, runnable  # most blocks run; fragments say why they cannot


@pytest.mark.slow
@pytest.mark.parametrize(("where", "skip", "code"), BLOCKS, ids=[where for where, _, _ in BLOCKS])
def test_docs_python_block_runs(where, skip, code, tmp_path):
    if skip is not None:
        pytest.skip(skip)
    script = tmp_path / "block.py"
    script.write_text(_shortened(code))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "MPLBACKEND": "Agg",
    }
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420
    )
    assert result.returncode == 0, f"{where}:\n{result.stderr[-3000:]}"
