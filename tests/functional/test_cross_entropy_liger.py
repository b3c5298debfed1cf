"""linear_cross_entropy's optional Liger-Kernel backend: dispatch and argument mapping, with the import mocked
(Liger's Triton kernels need CUDA; the GPU run measures the real one)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.nn import functional as F

from lightning_lowmem.functional.cross_entropy import linear_cross_entropy


@pytest.fixture
def fake_liger(monkeypatch):
    calls: list[dict] = []

    def liger_fused_linear_cross_entropy(**kwargs):
        calls.append(kwargs)
        logits = F.linear(kwargs["input"], kwargs["weight"], kwargs["bias"])
        return F.cross_entropy(
            logits,
            kwargs["target"],
            ignore_index=kwargs["ignore_index"],
            reduction=kwargs["reduction"],
            label_smoothing=kwargs["label_smoothing"],
        )

    module = types.ModuleType("liger_kernel.transformers.functional")
    module.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", module)
    return calls


def _inputs():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    bias = torch.randn(30, requires_grad=True)
    targets = torch.randint(30, (2, 5))
    targets[0, 0] = -100  # ignored
    return hidden, weight, bias, targets


def test_liger_backend_gets_flat_tensors_and_named_options(fake_liger):
    hidden, weight, bias, targets = _inputs()
    targets[0, 0] = -1  # ignored under ignore_index=-1
    loss = linear_cross_entropy(
        hidden, weight, targets, bias=bias, ignore_index=-1, reduction="sum", label_smoothing=0.1, backend="liger"
    )
    (call,) = fake_liger
    assert call["input"].shape == (10, 8) and call["weight"] is weight and call["bias"] is bias
    assert torch.equal(call["target"], targets.reshape(-1))
    assert (call["ignore_index"], call["reduction"], call["label_smoothing"]) == (-1, "sum", 0.1)
    reference = linear_cross_entropy(
        hidden, weight, targets, bias=bias, ignore_index=-1, reduction="sum", label_smoothing=0.1, backend="torch"
    )
    torch.testing.assert_close(loss, reference)
    assert len(fake_liger) == 1  # backend="torch" never calls it


def test_auto_uses_liger_only_for_cuda_tensors_and_not_for_none_reduction(fake_liger):
    hidden, weight, _, targets = _inputs()
    linear_cross_entropy(hidden, weight, targets)  # CPU: the torch paths
    linear_cross_entropy(hidden, weight, targets, reduction="none", backend="liger")  # per-token: torch
    assert fake_liger == []


def test_liger_backend_checks_targets_first(fake_liger):
    hidden, weight, _, targets = _inputs()
    targets[1, 1] = 30
    with pytest.raises(IndexError, match="class index 30, outside"):
        linear_cross_entropy(hidden, weight, targets, backend="liger")
    assert fake_liger == []


def test_liger_backend_without_liger_installed_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import raises ImportError
    hidden, weight, _, targets = _inputs()
    with pytest.raises(ImportError, match=r"lightning-lowmem\[liger\]"):
        linear_cross_entropy(hidden, weight, targets, backend="liger")
    assert torch.isfinite(linear_cross_entropy(hidden, weight, targets, backend="auto"))


def test_unknown_backend_is_refused():
    hidden, weight, _, targets = _inputs()
    with pytest.raises(ValueError, match=r"`backend`='triton' is not one of \['auto', 'torch', 'liger'\]"):
        linear_cross_entropy(hidden, weight, targets, backend="triton")
