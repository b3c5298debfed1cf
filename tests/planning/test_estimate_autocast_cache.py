"""Autocast's weight cache follows the runner: off as Lightning's MixedPrecision plugin runs autocast, on on request."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.memory import track_memory
from lightning_lowmem.planning.estimate import estimate_memory

WIDTH, BRANCHES = 512, 4
COPY = WIDTH * WIDTH * 2  # one weight's bf16 copy


class _Branches(nn.Module):
    """Linears on the raw batch: backward needs no weight, so only autocast's cache keeps their bf16 copies."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(BRANCHES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).float().square().mean()


def _forward_peak(model: nn.Module, batch: torch.Tensor, autocast) -> int:
    model.zero_grad(set_to_none=True)
    with track_memory(model, device="cpu") as tracking:
        with autocast:
            loss = _loss(model, batch)
        loss.backward()
    return tracking.report.phases["forward"]["peak_bytes"]


def _estimated_forward_peak(model: nn.Module, batch: torch.Tensor, **kwargs) -> int:
    report = estimate_memory(
        model, batch, loss_fn=_loss, optimizer="sgd", precision="bf16-mixed", device="cpu", steps=1, **kwargs
    )
    return report.phases["forward"]["peak_bytes"]


def test_the_estimate_runs_autocast_as_lightning_s_mixed_precision_plugin_does():
    from lightning.pytorch.plugins.precision import MixedPrecision

    model, batch = _Branches(), torch.randn(4, WIDTH)
    lightning = _forward_peak(model, batch, MixedPrecision("bf16-mixed", "cpu").forward_context())
    assert _estimated_forward_peak(model, batch) == lightning


def test_autocast_cache_true_keeps_every_cast_weight_through_the_forward_as_torch_s_default():
    model, batch = _Branches(), torch.randn(4, WIDTH)
    cached = _forward_peak(model, batch, torch.autocast("cpu", dtype=torch.bfloat16))
    assert _estimated_forward_peak(model, batch, autocast_cache=True) == cached
    # the last branch's copy is alive at the peak either way; the cache keeps the other three
    assert cached - _estimated_forward_peak(model, batch) == pytest.approx((BRANCHES - 1) * COPY, rel=0.02)


def test_the_report_says_whether_the_cache_was_on():
    model, batch = _Branches(), torch.randn(4, WIDTH)
    report = estimate_memory(model, batch, loss_fn=_loss, precision="bf16-mixed", device="cpu", autocast_cache=True)
    assert report.meta["autocast_cache"] is True
    assert "autocast_cache" not in estimate_memory(model, batch, loss_fn=_loss, device="cpu").meta
