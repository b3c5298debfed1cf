"""The Hugging Face example script runs end to end (a few steps): fine-tune with the lowmem stack, merge, int8."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_finetune_trains_merges_and_ships_int8(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    result = _load("hf_finetune").main(["--steps", "2", "--seq-len", "32", "--batch-size", "4"])
    assert all(math.isfinite(result[key]) for key in ("val_loss_before", "val_loss_after", "val_loss_int8"))
    assert result["size_ratio"] > 3.5  # Conv1D layers and the tied embeddings stored in int8
    assert abs(result["val_loss_int8"] - result["val_loss_after"]) < 0.05 * result["val_loss_after"]
    assert result["peak_bytes"] > 0


def test_hf_finetune_refuses_too_few_steps():
    with pytest.raises(SystemExit):
        _load("hf_finetune").parse_args(["--steps", "1"])
