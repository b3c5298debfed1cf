"""Bitmask + values packing: exact round trips, size, tied tensors, corrupt input."""

from __future__ import annotations

import io

import pytest
import torch

from lightning_lowmem.functional.pruning.sparse_format import (
    is_packed_sparse,
    pack_sparse,
    pack_sparse_tree,
    packed_nbytes,
    should_pack,
    unpack_sparse,
    unpack_sparse_tree,
)


def _sparse(shape, sparsity, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=generator).to(dtype)
    return dense * (torch.rand(shape, generator=generator) >= sparsity)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("shape", [(7,), (13, 5), (2, 3, 9), ()])
def test_round_trip_is_exact(dtype, shape):
    tensor = _sparse(shape, 0.8, dtype)
    restored = unpack_sparse(pack_sparse(tensor))
    assert restored.dtype == tensor.dtype and restored.shape == tensor.shape
    assert torch.equal(restored, tensor)


def test_nan_inf_and_all_zero_survive():
    tensor = torch.tensor([0.0, float("nan"), float("inf"), -0.0, -1e-30, 0.0, 0.0, 0.0, 3.0])
    restored = unpack_sparse(pack_sparse(tensor))
    assert torch.equal(restored.isnan(), tensor.isnan())
    assert torch.equal(restored.nan_to_num(), tensor.nan_to_num())
    zeros = torch.zeros(100)
    assert torch.equal(unpack_sparse(pack_sparse(zeros)), zeros)


def test_ninety_percent_sparse_fp32_is_seven_times_smaller():
    tensor = _sparse((256, 256), 0.9)
    packed = pack_sparse(tensor)
    ratio = tensor.nbytes / packed_nbytes(packed)
    assert 6.5 < ratio < 8.5  # 4N / (N/8 + ~0.4N) ~= 7.6


def test_should_pack_thresholds():
    assert should_pack(_sparse((64, 64), 0.9))
    assert not should_pack(_sparse((64, 64), 0.1))
    assert not should_pack(_sparse((8,), 0.9))  # below min_numel
    assert not should_pack(torch.zeros(4096, dtype=torch.long))  # not float
    assert should_pack(_sparse((8,), 0.9, seed=1), min_sparsity=0.5, min_numel=1) == (
        int((_sparse((8,), 0.9, seed=1) == 0).sum()) >= 4
    )


def test_tree_packs_once_for_tied_tensors_and_loads_weights_only():
    weight = _sparse((64, 64), 0.9)
    dense = torch.randn(64, 64)
    tree = {"a": weight, "b": weight, "nested": [dense, (weight, 3)], "step": 7}
    packed, count = pack_sparse_tree(tree)
    assert count == 1 and packed["a"] is packed["b"] and packed["nested"][0] is dense
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    loaded = unpack_sparse_tree(torch.load(buffer, weights_only=True))
    assert torch.equal(loaded["a"], weight) and torch.equal(loaded["nested"][1][0], weight)
    assert loaded["a"] is loaded["b"]  # tie kept
    assert loaded["step"] == 7 and torch.equal(loaded["nested"][0], dense)


def test_corrupt_pack_raises():
    packed = pack_sparse(_sparse((32, 32), 0.9))
    packed["values"] = packed["values"][:-1]
    with pytest.raises(ValueError, match=r"corrupt: bitmask marks \d+ non-zeros"):
        unpack_sparse(packed)
    with pytest.raises(ValueError, match="is not a packed sparse tensor"):
        unpack_sparse({"values": torch.zeros(1)})
    assert not is_packed_sparse(torch.zeros(1))


def test_tree_packs_a_tied_weight_once_from_a_real_state_dict():
    table = torch.nn.Embedding(64, 32)
    head = torch.nn.Linear(32, 64, bias=False)
    head.weight = table.weight
    with torch.no_grad():
        table.weight.mul_(torch.rand(64, 32) > 0.9)
    state = torch.nn.Sequential(table, head).state_dict()  # one detached tensor object per key
    assert state["0.weight"] is not state["1.weight"]
    packed, count = pack_sparse_tree(state)
    assert count == 1 and packed["0.weight"] is packed["1.weight"]
    restored = unpack_sparse_tree(packed)
    assert restored["0.weight"] is restored["1.weight"] and torch.equal(restored["1.weight"], table.weight)


def _old_layout(tensor):
    """What ``to_sparse_state_dict`` wrote before the one format: no marker, no device."""
    flat = tensor.flatten()
    nonzero = flat != 0
    bits = torch.zeros(-(-flat.numel() // 8) * 8, dtype=torch.uint8)
    bits[: flat.numel()] = nonzero.to(torch.uint8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
    return {
        "shape": list(tensor.shape),
        "bitmask": (bits.view(-1, 8) * weights).sum(1, dtype=torch.uint8),
        "values": flat[nonzero].clone(),
    }


def test_state_dict_export_writes_the_one_format_and_old_files_still_load(tmp_path):
    from lightning_lowmem.functional.pruning import from_sparse_state_dict, to_sparse_state_dict

    weight, bias = _sparse((16, 24), 0.8), torch.randn(16)
    packed = to_sparse_state_dict({"w": weight, "tied": weight, "b": bias})
    assert is_packed_sparse(packed["w"]) and packed["tied"] is packed["w"] and packed["b"] is bias
    assert torch.equal(unpack_sparse_tree(packed)["w"], weight)  # the format CompressedCheckpointIO reads
    old = _old_layout(weight)
    torch.save({"w": old, "tied": old, "b": bias, "step": 3}, tmp_path / "old.pt")
    restored = from_sparse_state_dict(torch.load(tmp_path / "old.pt", weights_only=True))
    assert torch.equal(restored["w"], weight) and restored["tied"] is restored["w"] and torch.equal(restored["b"], bias)
    assert restored["step"] == 3
    broken = {**old, "values": old["values"][:-1]}
    with pytest.raises(ValueError, match=r"packed sparse tensor of shape \[16, 24\] is corrupt"):
        from_sparse_state_dict({"w": broken})


def test_tree_keeps_unchanged_containers_and_a_state_dicts_metadata():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    dense = {"state_dict": model.state_dict(), "epoch": 1}
    assert pack_sparse_tree(dense)[0] is dense  # nothing packed: saved as it is, byte for byte torch.save's
    with torch.no_grad():
        model[0].weight.zero_()
    state = model.state_dict()
    packed, count = pack_sparse_tree({"state_dict": state})
    assert count == 1 and is_packed_sparse(packed["state_dict"]["0.weight"])
    # failed before: the rebuilt OrderedDict lost `_metadata` (module versions that load_state_dict reads)
    assert packed["state_dict"]._metadata == state._metadata
    restored = unpack_sparse_tree(packed)["state_dict"]
    assert restored._metadata == state._metadata and torch.equal(restored["0.weight"], state["0.weight"])


def test_should_pack_samples_first_and_still_sees_pruned_rows_and_columns():
    """A large tensor is sampled (every 61st value) before a full zero count: a dense one costs no full count, and
    pruned columns or rows (a structure a power-of-two stride could miss) still show."""
    from lightning_lowmem.functional.pruning.sparse_format import should_pack

    dense = torch.randn(512, 512)
    columns, rows = torch.randn(512, 512), torch.randn(512, 512)
    columns[:, 1::2] = 0  # half the columns pruned, none at a multiple of 64
    rows[::2] = 0
    assert not should_pack(dense) and should_pack(columns) and should_pack(rows)
    almost = torch.randn(512, 512)
    almost.view(-1)[: int(0.31 * almost.numel())] = 0  # 31% zeros, all at the start: a full count decides
    assert should_pack(almost, min_sparsity=0.3)
