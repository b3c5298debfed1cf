"""The bookkeeping of an adapter run in `functional/lora/bookkeeping.py`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.lora import apply_lora_
from lightning_lowmem.functional.lora.bookkeeping import (
    adapter_entries,
    check_same_settings,
    check_weights_path,
    checkpoint_record,
    load_base_weights_,
    parameter_metrics,
    settings_conflict,
    wrap_summary,
)
from lightning_lowmem.functional.optimizers import drop_frozen_

SETTINGS = {"r": 4, "alpha": 16.0, "quantize_base": None}


def _wrapped() -> tuple[nn.Sequential, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    return model, apply_lora_(model, r=4, target=["0"])


def test_counts_metrics_summary_and_optimizer_after_wrapping():
    model, report = _wrapped()
    trainable = 4 * 16 + 16 * 4  # lora_A (r, in) + lora_B (out, r) of layer 0
    total = 16 * 16 + 16 + 16 * 4 + 4 + trainable
    metrics = parameter_metrics(model, "lowmem/lora")
    assert metrics == {
        "lowmem/lora/trainable_params": float(trainable),
        "lowmem/lora/total_params": float(total),
        "lowmem/lora/trainable_fraction": pytest.approx(trainable / total),
    }
    assert wrap_summary(report).startswith(
        "LowRankAdapters: 1 layers wrapped (r=4, alpha=16); trainable parameters 128 of "
    )
    optimizer = torch.optim.AdamW(model.parameters())
    assert drop_frozen_([optimizer]) == 4  # two weights, two biases
    assert sum(p.numel() for p in optimizer.param_groups[0]["params"]) == trainable


def test_checkpoint_record_and_adapter_entries():
    model, report = _wrapped()
    entry = checkpoint_record({**SETTINGS, "alpha": 8.0}, report.wrapped, save_base_weights=False, version=1)
    assert entry == {
        "format": "adapters-only",
        "version": 1,
        "target": ["0"],
        "r": 4,
        "alpha": 8.0,
        "quantize_base": None,
        "needs": "callbacks=[LowRankAdapters(r=4, alpha=8.0)] (same target layers)",
    }
    assert checkpoint_record(SETTINGS, "all-linear", save_base_weights=True, version=1)["format"] == "full"
    assert sorted(adapter_entries(model.state_dict())) == ["0.lora_A", "0.lora_B"]


def test_settings_conflict_and_resume_check():
    assert settings_conflict({"r": 4, "alpha": 16.0}, SETTINGS, version=1) is None
    assert "version 2" in settings_conflict({"version": 2}, SETTINGS, version=1)
    message = settings_conflict({"r": 8, "needs": "LowRankAdapters(r=8)"}, SETTINGS, version=1)
    assert message == "its adapters have r=8 but this Trainer's LowRankAdapters has r=4; use LowRankAdapters(r=8)."
    check_same_settings({"r": 4, "target": ["other"]}, SETTINGS)  # target is not a setting that must match
    with pytest.raises(ValueError, match=r"trained with alpha=32.0 but this LowRankAdapters has alpha=16.0"):
        check_same_settings({"alpha": 32.0}, SETTINGS)


def test_weights_path_checks_and_base_weight_loading(tmp_path):
    check_weights_path("base_weights_path", tmp_path / "w.pt")
    with pytest.raises(ValueError, match=r"`base_weights_path` must be a file path or None, got list"):
        check_weights_path("base_weights_path", ["w.pt"])
    with pytest.raises(FileNotFoundError, match=r"`base_weights_path`=.*missing.pt' is not a file"):
        load_base_weights_(nn.Linear(2, 2), str(tmp_path / "missing.pt"))
    source, target = nn.Linear(3, 2), nn.Linear(3, 2)
    torch.save({"state_dict": source.state_dict()}, tmp_path / "ckpt.pt")  # a Lightning checkpoint's layout
    load_base_weights_(target, tmp_path / "ckpt.pt")
    assert torch.equal(target.weight, source.weight)
