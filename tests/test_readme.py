"""The README's Python quickstarts run as written, with the step count, and the first one's model and batch, cut
to keep the suite fast: its bf16 steps are emulated on a CPU without bf16 (~70x slower than fp32)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_quickstart_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python block"
    code = blocks[0]
    assert "max_steps=200" in code
    code = code.replace("max_steps=200", f"max_steps=2, limit_val_batches=0, default_root_dir={str(tmp_path)!r}")
    assert "CharLM(n_layer=6), CharLMDataModule(batch_size=32)" in code
    code = code.replace(
        "CharLM(n_layer=6), CharLMDataModule(batch_size=32)", "CharLM(n_layer=2), CharLMDataModule(batch_size=4)"
    )
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.global_step == 2
    monitor = next(c for c in trainer.callbacks if type(c).__name__ == "MemoryMonitor")
    assert monitor.last_report is not None and monitor.last_report.peak_bytes > 0
    assert monitor.last_report.breakdown["gradients"] < 0.5 * monitor.last_report.breakdown["parameters"]  # in-backward


def test_readme_hugging_face_quickstart_runs(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    code = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)[1]
    assert "HFLanguageModel" in code and "max_steps=60" in code and '"adamw8bit"' in code
    # 2 steps; Adafactor because torchao compiles its 8-bit step per tensor shape on a CPU (minutes on 2 cores)
    code = code.replace("max_steps=60", f"max_steps=2, limit_val_batches=0, default_root_dir={str(tmp_path)!r}")
    code = code.replace('"adamw8bit"', '"adafactor"')
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    trainer, model = namespace["trainer"], namespace["model"]
    assert trainer.global_step == 2
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert trainer.callbacks[1].wrapped == [f"model.transformer.h.{i}" for i in range(4)]
    assert model.model.config.use_cache is True  # restored after fit
