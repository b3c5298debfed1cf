"""estimate_memory(..., world_size=N, sharding=...): per-rank figures for DDP, ZeRO-1 and FSDP, and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_lowmem.demo.charlm import CharLM
from lightning_lowmem.planning.estimate import EstimationError, estimate_memory
from lightning_lowmem.planning.sharding import zero_partition


@pytest.fixture
def no_process_group():
    if dist.is_initialized():  # left by an in-process Lightning run: the fake ranks need their own group
        dist.destroy_process_group()
    yield


def _model_and_batch():
    torch.manual_seed(0)
    model = CharLM(n_layer=2, n_head=2, n_embd=32, block_size=16)
    return model, (torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, r"`world_size`=0 must be an int >= 1"),
        ({"world_size": True}, r"`world_size`=True must be an int >= 1"),
        (
            {"world_size": 2, "sharding": "fdsp"},
            r"`sharding`='fdsp' is unknown; choose None, 'ddp', 'zero1' or 'fsdp'. Did you mean 'fsdp'\?",
        ),
    ],
)
def test_bad_input(kwargs, match):
    model, batch = _model_and_batch()
    with pytest.raises(ValueError, match=match):
        estimate_memory(model, batch, device="cpu", **kwargs)


def test_fsdp_shards_parameters_gradients_and_state(no_process_group):
    model, batch = _model_and_batch()
    one = estimate_memory(model, batch, device="cpu", sharding="fsdp", world_size=1)
    four = estimate_memory(model, batch, device="cpu", sharding="fsdp", world_size=4)
    params = sum(p.numel() * 4 for p in model.parameters())
    steps = 4 * len(list(model.parameters()))  # AdamW's scalar `step` per parameter, not sharded
    # AdamW: two fp32 moments per parameter; every dim-0 here divides by 4, so a rank holds exactly a quarter
    assert one.breakdown["optimizer_state"] == 2 * params + steps
    assert four.breakdown["optimizer_state"] == 2 * params // 4 + steps
    # at the peak: the local shards plus at most the root's and two blocks' gathered parameters
    block = sum(p.numel() * 4 for p in model.model.h[0].parameters())
    assert params // 4 < four.breakdown["parameters"] <= params // 4 + (params - 2 * block) + 2 * block
    assert four.peak_bytes < one.peak_bytes
    assert four.meta["sharding"] == "fsdp" and len(four.meta["per_rank"]) == 4
    assert not dist.is_initialized()  # the fake process group is gone


def test_ddp_keeps_every_gradient_and_zero1_splits_the_state_by_its_partition(no_process_group):
    model, batch = _model_and_batch()
    single = estimate_memory(model, batch, device="cpu")
    ddp = estimate_memory(model, batch, device="cpu", world_size=2)  # sharding defaults to "ddp"
    zero = estimate_memory(model, batch, device="cpu", world_size=2, sharding="zero1")
    params = sum(p.numel() * 4 for p in model.parameters())
    assert ddp.meta["sharding"] == "ddp" and ddp.breakdown["gradients"] == params  # buckets hold all of them
    assert ddp.peak_bytes >= single.peak_bytes
    states = [rank["breakdown"]["optimizer_state"] for rank in zero.meta["per_rank"]]
    steps = 4 * len(list(model.parameters()))
    assert abs(sum(states) - 2 * params - steps) <= 2 and 0.45 < max(states) / (2 * params) < 0.55
    assert zero.peak_bytes < ddp.peak_bytes


def test_zero_partition_replays_the_greedy_largest_first_rule():
    assert zero_partition([[10, 1, 7, 3]], 2) == [
        [(0, 0), (0, 1)],
        [(0, 2), (0, 3)],
    ]  # 10 | 7, 3 | then 1 to the first of two equal ranks


def test_fsdp_estimate_inside_a_process_group_says_where_to_run_it(tmp_path, no_process_group):
    model, batch = _model_and_batch()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(
            EstimationError, match=r"already has one \(gloo, world size 1\).*lowmem estimate --devices N"
        ):
            estimate_memory(model, batch, device="cpu", world_size=2, sharding="fsdp")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("device", "copies"), [("cpu", 1), ("cuda", 0)])
def test_a_simulated_gloo_reduce_scatter_holds_a_copy_of_its_input(no_process_group, device, copies):
    """gloo (CPU) reduces a copy of the reduce-scatter input and stages the all-gather output in a buffer of its
    own, each for the call; NCCL (GPU) works in place."""
    from lightning_lowmem._compat.distributed import fsdp_collective_names
    from lightning_lowmem._compat.fake_mode import fake_tensor_mode
    from lightning_lowmem.memory._tracker import StorageTracker
    from lightning_lowmem.planning.sharding import ShardedStep

    with ShardedStep("fsdp", world_size=2, device=device), fake_tensor_mode():
        gradients, shard = torch.empty(1024), torch.empty(512)  # made before tracking
        names = fsdp_collective_names()  # torch 2.11 has other names
        with StorageTracker(device="cpu") as tracker:
            getattr(dist, names["reduce_scatter"])(shard, gradients)
        with StorageTracker(device="cpu") as gather:
            getattr(dist, names["all_gather"])(gradients, shard)
    assert tracker.report.peak_bytes == 4096 + 2048 + copies * 4096
    assert tracker.report.end_bytes == 4096 + 2048  # the copy is gone after the call
    assert gather.report.peak_bytes == 4096 + 2048 + copies * 4096  # staged: the output's size
    assert gather.report.end_bytes == 4096 + 2048
