"""ZeRO-1 helpers on a one-process gloo group: the wrapper keeps the optimizer, its groups and its state once."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from lightning_lowmem.functional.optimizers.catalog import build_optimizer
from lightning_lowmem.memory import state_bytes
from lightning_lowmem.strategies.zero import drop_duplicate_state, shard_optimizer


@pytest.fixture
def process_group(tmp_path):
    if dist.is_initialized():  # left by an in-process DDP test: one process either way
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _two_groups(model: nn.Module) -> list[dict]:
    return [
        {"params": list(model[0].parameters()), "lr": 1e-2, "weight_decay": 0.0},
        {"params": list(model[1].parameters()), "lr": 1e-3},
    ]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    device = next(model.parameters()).device
    model(torch.ones(2, 8, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_shard_keeps_class_groups_and_matches_the_plain_optimizer(process_group):
    torch.manual_seed(0)
    plain_model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    zero_model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    zero_model.load_state_dict(plain_model.state_dict())
    plain = torch.optim.AdamW(_two_groups(plain_model), weight_decay=0.1, betas=(0.8, 0.99))
    zero = shard_optimizer(torch.optim.AdamW(_two_groups(zero_model), weight_decay=0.1, betas=(0.8, 0.99)))
    assert isinstance(zero, ZeroRedundancyOptimizer) and type(zero.optim) is torch.optim.AdamW
    assert [(g["lr"], g["weight_decay"], g["betas"]) for g in zero.optim.param_groups] == [
        (1e-2, 0.0, (0.8, 0.99)),
        (1e-3, 0.1, (0.8, 0.99)),
    ]
    for _ in range(2):
        _step(plain_model, plain)
        _step(zero_model, zero)
    for a, b in zip(plain_model.parameters(), zero_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert shard_optimizer(zero) is zero


def test_shard_by_name_keeps_what_the_name_means(process_group):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    zero = shard_optimizer(build_optimizer("sgd", _two_groups(model)), name="sgd")
    assert type(zero.optim) is torch.optim.SGD
    assert [g["momentum"] for g in zero.optim.param_groups] == [0.9, 0.9]  # the name's default, not SGD's 0
    assert [g["lr"] for g in zero.optim.param_groups] == [1e-2, 1e-3]


def test_in_backward_optimizers_cannot_be_sharded():
    model = nn.Linear(4, 4)
    optimizer = build_optimizer("sgd_in_backward", model.parameters(), lr=0.1)
    try:
        with pytest.raises(ValueError, match=r"`zero_optimizer`=True cannot shard OptimizerInBackward"):
            shard_optimizer(optimizer)
    finally:
        optimizer.remove_hooks()


def _saved_and_resumed(model: nn.Module, map_location: str) -> tuple[int, dict, torch.optim.Optimizer]:
    zero = shard_optimizer(torch.optim.AdamW(model.parameters()))
    _step(model, zero)
    held = state_bytes(optimizers=[zero])["optimizer_state"]
    zero.consolidate_state_dict(to=0)
    saved = zero.state_dict()
    assert len(saved["state"]) == 4  # full state: every parameter
    loaded = {**saved, "state": {k: {n: t.to(map_location) for n, t in v.items()} for k, v in saved["state"].items()}}
    resumed = shard_optimizer(torch.optim.AdamW(model.parameters()))
    resumed.load_state_dict(loaded)
    return held, saved, resumed


def test_resumed_state_keeps_stepping_after_the_duplicate_is_dropped(process_group):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    held, saved, resumed = _saved_and_resumed(model, "cpu")
    drop_duplicate_state(resumed)
    assert state_bytes(optimizers=[resumed])["optimizer_state"] == held
    _step(model, resumed)  # still steps, and still saves the full state
    resumed.consolidate_state_dict(to=0)
    assert resumed.state_dict()["state"].keys() == saved["state"].keys()


@pytest.mark.cuda
def test_state_loaded_from_host_memory_is_held_once_on_the_gpu(process_group):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)).cuda()
    held, _, resumed = _saved_and_resumed(model, "cpu")  # e.g. torch.load(map_location="cpu")
    assert state_bytes(optimizers=[resumed])["optimizer_state"] > held  # the wrapper's own copy
    drop_duplicate_state(resumed)
    assert state_bytes(optimizers=[resumed])["optimizer_state"] == held
