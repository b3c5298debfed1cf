"""LoRA leaves a module a technique froze and marked (``FROZEN_MARK``) without adapters, whatever the target."""

from __future__ import annotations

from torch import nn

from lightning_lowmem.functional.lora import apply_lora_
from lightning_lowmem.functional.lora.targets import FROZEN_MARK


def test_a_marked_module_gets_no_adapter():
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8)))
    model[0].__dict__[FROZEN_MARK] = True
    report = apply_lora_(model, r=2, target="all-linear", train_modules=None)
    assert report.wrapped == ["1.0"]
    assert report.trainable_params == 2 * (8 + 8)  # one adapter: A (2x8) and B (8x2)
