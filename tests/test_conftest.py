"""``tests/conftest.py``'s isolation: what Lightning writes into ``os.environ`` in one test does not reach the next
(a spawned rank inherits it: a ``PL_GLOBAL_SEED`` left by ``L.seed_everything`` re-seeds every rank of a later
DDP / FSDP fit at setup)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TWO_TESTS = """
import os

import lightning as L


def test_seeds():
    L.seed_everything(3, workers=True, verbose=False)
    os.environ["MASTER_PORT"] = "12345"  # as Lightning's launchers write it
    assert os.environ["PL_GLOBAL_SEED"] == "3" and os.environ["PL_SEED_WORKERS"] == "1"


def test_runs_after():
    leaked = {key: os.environ.get(key) for key in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "MASTER_PORT")}
    assert leaked == {"PL_GLOBAL_SEED": None, "PL_SEED_WORKERS": None, "MASTER_PORT": None}
    assert os.environ["OUTER"] == "kept"  # what the session started with stays
"""


def test_the_seed_and_port_one_test_sets_are_gone_in_the_next(tmp_path):
    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_two.py").write_text(TWO_TESTS)
    env = {**os.environ, "OUTER": "kept", "PL_GLOBAL_SEED": "7"}  # a seed from outside: cleared too
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:rerunfailures", "test_two.py"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout + result.stderr
