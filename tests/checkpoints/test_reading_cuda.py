"""``read_checkpoint`` / ``CompressedCheckpointIO.load_checkpoint`` on CUDA: packed sparse tensors land where
``map_location`` puts the dense ones, for every kind of ``map_location``. GPU only (``cuda`` marker)."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem.checkpoints import CompressedCheckpointIO

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize(
    ("map_location", "expected"),
    [
        (None, "cpu"),
        ("cuda", "cuda"),
        ({"cuda:0": "cpu"}, "cpu"),
        (lambda storage, loc: storage, "cpu"),  # Lightning's default: storages stay where torch built them
        (lambda storage, loc: storage.cuda(), "cuda"),
        (lambda storage, loc: None, "cuda"),  # None: where it was saved
    ],
)
def test_sparse_and_dense_tensors_follow_map_location(tmp_path, map_location, expected):
    sparse = torch.zeros(64, 64, device="cuda")
    sparse[0, :8] = 1.0
    checkpoint = {"state_dict": {"sparse": sparse, "dense": torch.randn(64, 64, device="cuda")}}
    checkpoint_io = CompressedCheckpointIO()
    checkpoint_io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert checkpoint_io.last_save_stats["sparse_tensors"] == 1
    loaded = checkpoint_io.load_checkpoint(tmp_path / "a.ckpt", map_location=map_location)["state_dict"]
    assert {name: tensor.device.type for name, tensor in loaded.items()} == {"sparse": expected, "dense": expected}
    assert torch.equal(loaded["sparse"].cpu(), sparse.cpu()) and torch.equal(
        loaded["dense"].cpu(), checkpoint["state_dict"]["dense"].cpu()
    )
