"""The README's Python quickstart runs as written (with the step count cut to keep the suite fast)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_quickstart_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python block"
    code = blocks[0]
    assert "max_steps=200" in code
    code = code.replace("max_steps=200", f"max_steps=2, limit_val_batches=0, default_root_dir={str(tmp_path)!r}")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.global_step == 2
    monitor = next(c for c in trainer.callbacks if type(c).__name__ == "MemoryMonitor")
    assert monitor.last_report is not None and monitor.last_report.peak_bytes > 0
    assert monitor.last_report.breakdown["gradients"] < 0.5 * monitor.last_report.breakdown["parameters"]  # in-backward
