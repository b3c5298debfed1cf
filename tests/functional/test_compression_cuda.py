"""``compress_activations("cpu")`` on CUDA: saved activations go to pinned host memory on a side stream
and come back for backward, exactly. GPU only (``cuda`` marker)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.compression import CompressionStats, compress_activations

pytestmark = pytest.mark.cuda


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)]
    return nn.Sequential(*layers).cuda()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_cpu_offload_frees_device_memory_and_backward_is_exact():
    model = _mlp()
    x = torch.randn(512, 1024, device="cuda")
    model(x).square().mean().backward()
    reference = _grads(model)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    kept = model(x).square().mean()
    torch.cuda.synchronize()
    kept_bytes = torch.cuda.memory_allocated() - before  # activations saved for backward, on the device
    del kept

    stats = CompressionStats()
    with compress_activations("cpu", min_bytes=0, stats=stats):
        loss = model(x).square().mean()
    torch.cuda.synchronize()  # the side-stream copies are done: the device copies can be freed
    offloaded_bytes = torch.cuda.memory_allocated() - before
    assert stats.packed > 0 and stats.bytes_out == 0  # nothing of what was packed stays on the device
    assert offloaded_bytes < kept_bytes - 0.8 * stats.bytes_in, (kept_bytes, offloaded_bytes, stats)

    # reuse the freed device memory before backward: a copy still reading it (a race) would corrupt grads
    junk = [torch.full((512, 4096), float("nan"), device="cuda") for _ in range(8)]
    loss.backward()
    del junk
    for got, want in zip(_grads(model), reference, strict=True):
        torch.testing.assert_close(got, want)


def test_cpu_offload_keeps_parameters_and_small_tensors_on_the_device():
    model = _mlp()
    stats = CompressionStats()
    with compress_activations("cpu", stats=stats):  # default min_bytes: 64 KiB
        loss = model(torch.randn(2, 1024, device="cuda")).sum()  # the largest, (2, 4096) fp32, is 32 KiB: kept
    loss.backward()
    assert stats.packed == 0 and stats.kept > 0
    assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())
