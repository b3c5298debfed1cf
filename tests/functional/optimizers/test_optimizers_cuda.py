"""torchao's low-bit AdamW on CUDA: the compiled (fused) per-parameter step torchao runs by default does
what the eager step does, with a quarter (8-bit) or an eighth (4-bit) of AdamW's state. GPU only."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.optimizers.catalog import build_optimizer
from lightning_lowmem.memory import state_bytes

pytestmark = pytest.mark.cuda


def _model() -> nn.Module:
    # one weight shape: torchao compiles its step once per shape (seconds each), and one is enough here
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512, bias=False), nn.GELU(), nn.Linear(512, 512, bias=False)).cuda()


def _train(model: nn.Module, name: str, eager: bool, steps: int = 3) -> torch.optim.Optimizer:
    optimizer = build_optimizer(name, model.parameters(), lr=1e-3)
    generator = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 512, device="cuda", generator=generator)
        model(x).square().mean().backward()
        with torch.compiler.set_stance("force_eager") if eager else torch.compiler.set_stance("default"):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return optimizer


@pytest.mark.parametrize(("name", "max_state_ratio"), [("adamw8bit", 0.3), ("adamw4bit", 0.2)])
def test_compiled_low_bit_step_matches_eager_and_keeps_state_small(name, max_state_ratio):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # dynamo's own statistics (no public twin): did the step compile?
    start = _model()
    compiled, eager, plain = copy.deepcopy(start), copy.deepcopy(start), copy.deepcopy(start)
    compiled_opt = _train(compiled, name, eager=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "torchao's step did not compile"
    _train(eager, name, eager=True)
    plain_opt = _train(plain, "adamw", eager=True)
    for c, e, s in zip(compiled.parameters(), eager.parameters(), start.parameters(), strict=True):
        update = (e - s).abs().max()
        assert update > 0
        assert (c - e).abs().max() <= 0.05 * update, name  # the same step, up to rounding of the quantized state
    ratio = state_bytes(None, [compiled_opt])["optimizer_state"] / state_bytes(None, [plain_opt])["optimizer_state"]
    assert ratio <= max_state_ratio, ratio
