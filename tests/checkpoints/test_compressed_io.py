"""CompressedCheckpointIO (lightning_lowmem.checkpoints): exact round trips, size on a 90%-sparse charlm, corrupt files, crash safety."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap

import lightning as L
import pytest
from lightning.pytorch.plugins.io import TorchCheckpointIO
import torch
from torch import nn

from lightning_lowmem.checkpoints import compressed_io, file_format
from lightning_lowmem.checkpoints.compressed_io import CheckpointCorruptError, CompressedCheckpointIO


def _tensors(obj, prefix=""):
    """Flatten every tensor of a nested checkpoint to {path: tensor}."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    found = {}
    for key, value in items:
        found.update(_tensors(value, f"{prefix}/{key}"))
    return found


def _checkpoint():
    torch.manual_seed(0)
    sparse = torch.randn(128, 64) * (torch.rand(128, 64) > 0.9)
    return {
        "state_dict": {
            "w_sparse": sparse,
            "w_dense": torch.randn(32, 32),
            "tied": sparse,
            "bf16": (torch.randn(64, 64) * (torch.rand(64, 64) > 0.5)).bfloat16(),
            "count": torch.tensor(5, dtype=torch.int64),
            "mask": torch.rand(40, 40) > 0.5,
        },
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": sparse * 0.1}},
                "param_groups": [{"lr": 1e-3, "params": [0]}],
            }
        ],
        "epoch": 2,
        "global_step": 40,
        "pytorch-lightning_version": "2.6.6",
        "callbacks": {"x": {"best": None}},
    }


@pytest.mark.parametrize("codec", ["zstd", "lz4", "none"])
def test_round_trip_every_tensor_equal(tmp_path, codec):
    checkpoint = _checkpoint()
    checkpoint_io = CompressedCheckpointIO(codec=codec)
    path = tmp_path / "a.ckpt"
    checkpoint_io.save_checkpoint(checkpoint, path)
    loaded = checkpoint_io.load_checkpoint(path)
    expected, got = _tensors(checkpoint), _tensors(loaded)
    assert expected.keys() == got.keys()
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert loaded["epoch"] == 2 and loaded["callbacks"] == {"x": {"best": None}}
    assert loaded["state_dict"]["tied"] is loaded["state_dict"]["w_sparse"]
    assert checkpoint_io.last_save_stats["sparse_tensors"] == 3  # w_sparse (tied once), bf16, exp_avg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]  # no temporary file left behind


def test_reads_plain_torch_save_checkpoints(tmp_path):
    checkpoint = _checkpoint()
    torch.save(checkpoint, tmp_path / "plain.ckpt")
    loaded = CompressedCheckpointIO().load_checkpoint(tmp_path / "plain.ckpt")
    assert torch.equal(loaded["state_dict"]["w_dense"], checkpoint["state_dict"]["w_dense"])


def test_loads_with_weights_only(tmp_path):
    checkpoint_io = CompressedCheckpointIO()
    checkpoint_io.save_checkpoint({"state_dict": {}, "module": nn.Linear(2, 2)}, tmp_path / "m.ckpt")
    with pytest.raises(Exception, match="[Ww]eights.only"):
        checkpoint_io.load_checkpoint(tmp_path / "m.ckpt")
    assert isinstance(checkpoint_io.load_checkpoint(tmp_path / "m.ckpt", weights_only=False)["module"], nn.Linear)


def _pruned_charlm_state(sparsity=0.9):
    from lightning_lowmem.demo import CharLM

    torch.manual_seed(0)
    model = CharLM()  # the reference charlm (4 layers, n_embd 128)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:  # every weight matrix (embeddings included), magnitude pruning per tensor
                threshold = param.abs().flatten().kthvalue(int(sparsity * param.numel())).values
                param.mul_(param.abs() > threshold)
    return model.state_dict()


def test_ninety_percent_sparse_charlm_is_five_times_smaller(tmp_path):
    checkpoint = {"state_dict": _pruned_charlm_state(), "epoch": 0, "global_step": 100}
    torch.save(checkpoint, tmp_path / "plain.ckpt")
    CompressedCheckpointIO(codec="zstd").save_checkpoint(checkpoint, tmp_path / "small.ckpt")
    ratio = (tmp_path / "plain.ckpt").stat().st_size / (tmp_path / "small.ckpt").stat().st_size
    assert ratio >= 5.0, f"only {ratio:.2f}x smaller"
    loaded = CompressedCheckpointIO().load_checkpoint(tmp_path / "small.ckpt")
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in checkpoint["state_dict"].items())


@pytest.mark.parametrize("keep", [0.5, 0.99, 10])
def test_truncated_file_raises_naming_the_file(tmp_path, keep):
    path = tmp_path / "cut.ckpt"
    CompressedCheckpointIO().save_checkpoint(_checkpoint(), path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(CheckpointCorruptError, match=r"cut\.ckpt.*(truncated|damaged)"):
        CompressedCheckpointIO().load_checkpoint(path)


def test_truncated_plain_file_raises_naming_the_file(tmp_path):
    path = tmp_path / "plain.ckpt"
    torch.save(_checkpoint(), path)
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(CheckpointCorruptError, match=r"plain\.ckpt.*truncated or damaged"):
        CompressedCheckpointIO().load_checkpoint(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        CompressedCheckpointIO().load_checkpoint(tmp_path / "nope.ckpt")


_WRITER = """
import sys, time, torch
from lightning_lowmem.checkpoints import compressed_io as cio, file_format

def stalled(path, pieces, fsync=False, _real=file_format.atomic_write):
    def slow():
        written = 0
        for piece in pieces:
            piece = bytes(piece)
            if written < (1 << 16) <= written + len(piece):  # a piece big enough to pass the write buffer
                yield piece[: len(piece) // 2]
                print("HALF", flush=True)  # half-written: the parent kills us now
                time.sleep(120)
                piece = piece[len(piece) // 2 :]
            written += len(piece)
            yield piece
    return _real(path, slow(), fsync)

file_format.atomic_write = stalled
big = {"state_dict": {"w": torch.randn(512, 512), "pruned": torch.zeros(512, 512)}, "epoch": 2}
cio.CompressedCheckpointIO().save_checkpoint(big, sys.argv[1])
"""


def test_killed_writer_leaves_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "last.ckpt"
    good = {"state_dict": {"w": torch.arange(10.0)}, "epoch": 1}
    CompressedCheckpointIO().save_checkpoint(good, path)
    before = path.read_bytes()
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_WRITER), str(path)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        assert writer.stdout.readline().strip() == "HALF"
        temporary = list(tmp_path.glob("last.tmp-*.framed"))
        assert len(temporary) == 1 and temporary[0].stat().st_size > 0  # the new one was being written
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert path.read_bytes() == before
    loaded = CompressedCheckpointIO().load_checkpoint(path)
    assert loaded["epoch"] == 1 and torch.equal(loaded["state_dict"]["w"], good["state_dict"]["w"])


class _Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        inputs, targets = torch.randn(24, 16, generator=generator), torch.randn(24, 1, generator=generator)
        data = torch.utils.data.TensorDataset(inputs, targets)
        return torch.utils.data.DataLoader(data, batch_size=8)  # 3 steps per epoch: resume at an epoch end


def _fit_and_resume(kwargs, plugins):
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=3, plugins=plugins, **kwargs)
    trainer.fit(_Regressor())
    path = trainer.checkpoint_callback.best_model_path
    resumed = _Regressor()
    L.Trainer(max_steps=6, plugins=plugins, **kwargs).fit(resumed, ckpt_path=path)
    return path, resumed


def test_trainer_checkpoints_and_resume_match_torch_checkpoint_io(tmp_path, tiny_trainer_kwargs):
    kwargs = dict(tiny_trainer_kwargs, enable_checkpointing=True)
    plain_path, plain = _fit_and_resume({**kwargs, "default_root_dir": str(tmp_path / "plain")}, [])
    packed_path, packed = _fit_and_resume(
        {**kwargs, "default_root_dir": str(tmp_path / "packed")}, [CompressedCheckpointIO()]
    )
    with open(packed_path, "rb") as handle:  # 2x64 weights, mostly zero-free: chunks stored, some compressed
        assert handle.read(len(file_format.PREFIX) + 8) == file_format.PREFIX + b"LOWMEMCK"
    expected = _tensors(torch.load(plain_path, weights_only=True))
    got = _tensors(CompressedCheckpointIO().load_checkpoint(packed_path))
    assert expected.keys() == got.keys() and len(expected) > 6  # weights and AdamW state
    assert all(torch.equal(expected[key], got[key]) for key in expected)
    for (name, a), b in zip(plain.state_dict().items(), packed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"codec": "gzip"}, ValueError, r"`codec`='gzip' is unknown; choose one of \['zstd', 'lz4', 'none'\]"),
        ({"level": "high"}, TypeError, r"`level` must be an int or None, got str"),
        ({"min_sparsity": 1.5}, ValueError, r"`min_sparsity`=1.5 must be in \[0, 1\]"),
        ({"min_numel": -1}, ValueError, r"`min_numel`=-1 must be >= 0"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        CompressedCheckpointIO(**kwargs)


def test_storage_options_rejected(tmp_path):
    with pytest.raises(TypeError, match="`storage_options` is not supported"):
        CompressedCheckpointIO().save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})


@pytest.mark.parametrize("cut_from_end", [1, 22, 400, 0.3])
def test_truncated_plain_file_anywhere_raises_corrupt(tmp_path, cut_from_end):
    path = tmp_path / "plain.ckpt"
    torch.save(_checkpoint(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - (cut_from_end if cut_from_end >= 1 else int(cut_from_end * len(data)))])
    # failed before: ValueError: negative seek value
    with pytest.raises(CheckpointCorruptError, match=r"plain\.ckpt.*truncated or damaged: torch.load failed"):
        CompressedCheckpointIO().load_checkpoint(path)


def test_plain_torch_load_of_a_compressed_file_names_the_plugin(tmp_path, tiny_trainer_kwargs):
    path = tmp_path / "packed.ckpt"
    CompressedCheckpointIO().save_checkpoint(_checkpoint(), path)
    assert path.read_bytes().startswith(file_format.PREFIX)
    # failed before (#26 item 10): "Weights only load failed ... Re-running `torch.load` with `weights_only` set to
    # `False` will likely succeed" (it did not); now, with lightning_lowmem imported, one line saying what to use
    message = (
        r"^this file was written by lightning_lowmem's CompressedCheckpointIO \(not a torch.save file\): load it with "
        r"`Trainer\(plugins=\[CompressedCheckpointIO\(\)\]\)` or `lightning_lowmem.checkpoints.read_checkpoint\(path\)`$"
    )
    for weights_only in (True, False):
        with pytest.raises(RuntimeError, match=message):
            torch.load(path, weights_only=weights_only)
    with pytest.raises(RuntimeError, match=message):  # a Trainer without the plugin (Lightning: weights_only=None)
        L.Trainer(max_steps=6, **tiny_trainer_kwargs).fit(_Regressor(), ckpt_path=path)
    assert CompressedCheckpointIO().load_checkpoint(path)["state_dict"].keys() == _checkpoint()["state_dict"].keys()


def test_without_lightning_lowmem_imported_torch_names_the_plugin(tmp_path):
    """In a process that never imported lightning_lowmem, torch's refusal still names the plugin (the global)."""
    import subprocess
    import sys

    path = tmp_path / "packed.ckpt"
    CompressedCheckpointIO().save_checkpoint(_checkpoint(), path)
    code = f"import torch\ntry:\n    torch.load({str(path)!r})\nexcept Exception as err:\n    print(err)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert (
        "Unsupported global: GLOBAL lightning_lowmem.plugins.compressed_checkpoint_io.written_by_CompressedCheckpointIO"
        in out
    )


def test_dense_checkpoint_is_stored_raw_and_never_larger(tmp_path):
    torch.manual_seed(0)
    dense = {"state_dict": {f"w{i}": torch.randn(512, 512) for i in range(5)}, "epoch": 1}  # 5 MiB of mantissas
    TorchCheckpointIO().save_checkpoint(dense, tmp_path / "dense.ckpt")
    plain = (tmp_path / "dense.ckpt").read_bytes()
    checkpoint_io = CompressedCheckpointIO()
    checkpoint_io.save_checkpoint(dense, tmp_path / "dense.ckpt")
    stats = checkpoint_io.last_save_stats
    assert (
        stats["chunks"] == 6 and stats["chunks_compressed"] <= 1
    )  # 1 MiB chunks of mantissas raw (the tail: zip index)
    assert (tmp_path / "dense.ckpt").read_bytes() == plain  # the very same bytes: loads without the plugin
    loaded = checkpoint_io.load_checkpoint(tmp_path / "dense.ckpt")
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in dense["state_dict"].items())
    # mixed: one sparse tensor packed, dense chunks raw, the file framed and smaller
    mixed = {"state_dict": {**dense["state_dict"], "zeros": torch.zeros(512, 512)}}
    checkpoint_io.save_checkpoint(mixed, tmp_path / "mixed.ckpt")
    assert checkpoint_io.last_save_stats["sparse_tensors"] == 1
    assert (tmp_path / "mixed.ckpt").read_bytes().startswith(file_format.PREFIX)
    assert torch.equal(
        checkpoint_io.load_checkpoint(tmp_path / "mixed.ckpt")["state_dict"]["w3"], dense["state_dict"]["w3"]
    )


def test_damaged_chunk_table_raises(tmp_path):
    path = tmp_path / "a.ckpt"
    CompressedCheckpointIO().save_checkpoint(_checkpoint(), path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the last chunk
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"a\.ckpt.*truncated or damaged"):
        CompressedCheckpointIO().load_checkpoint(path)


def test_reads_version_one_files(tmp_path):
    import struct
    import zlib

    import zstandard

    buffer = io.BytesIO()
    torch.save({"epoch": 7, "w": torch.arange(4.0)}, buffer)
    raw = buffer.getvalue()
    header = struct.pack("<8sB7sQI", b"LOWMEMCK", 1, b"zstd".ljust(7, b"\0"), len(raw), zlib.crc32(raw))
    (tmp_path / "v1.ckpt").write_bytes(header + zstandard.ZstdCompressor().compress(raw))
    assert CompressedCheckpointIO().load_checkpoint(tmp_path / "v1.ckpt")["epoch"] == 7


def test_quantized_weights_load_under_lightnings_callable_map_location(tmp_path):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = nn.Sequential(nn.Linear(64, 64))
    quantize_(model, Int8WeightOnlyConfig())
    path = tmp_path / "q.ckpt"
    CompressedCheckpointIO().save_checkpoint({"state_dict": model.state_dict()}, path)
    # failed before: RuntimeError: Callable map_location not supported with _rebuild_wrapper_subclass
    loaded = CompressedCheckpointIO().load_checkpoint(path, map_location=lambda storage, loc: storage)
    weight = loaded["state_dict"]["0.weight"]
    assert type(weight).__name__ == type(model[0].weight).__name__ and weight.device.type == "cpu"
    assert torch.equal(weight.dequantize(), model[0].weight.dequantize())


def test_one_class_behind_every_import_path():
    import lightning_lowmem
    from lightning_lowmem import checkpoints, plugins
    from lightning_lowmem.plugins import compressed_checkpoint_io as old_module

    assert (
        lightning_lowmem.CompressedCheckpointIO is checkpoints.CompressedCheckpointIO is plugins.CompressedCheckpointIO
    )
    assert old_module.CompressedCheckpointIO is compressed_io.CompressedCheckpointIO
    assert (
        lightning_lowmem.CheckpointCorruptError is plugins.CheckpointCorruptError is file_format.CheckpointCorruptError
    )
    # what a plain torch.load of a compressed file calls, by the path written in the file's first bytes
    assert old_module.written_by_CompressedCheckpointIO is file_format.written_by_CompressedCheckpointIO


def test_incompressible_weights_skip_the_in_memory_copy_and_chunking(tmp_path, monkeypatch):
    """Dense fp32 weights: a few samples decide, the file is torch.save's straight to disk (no chunk compressed,
    not even sampled); a checkpoint whose tensors compress still takes the chunked path."""
    torch.manual_seed(0)
    dense = {"state_dict": {f"w{i}": torch.randn(512, 512) for i in range(4)}, "epoch": 1}
    assert file_format.samples_say_plain(dense["state_dict"].values(), "zstd", 3, 0.1)
    assert not file_format.samples_say_plain([torch.rand(512, 512).round()], "zstd", 3, 0.1)  # 0s and 1s
    calls = []
    monkeypatch.setattr(compressed_io, "pack_chunks", lambda *args: calls.append(args) or [])
    checkpoint_io = CompressedCheckpointIO()
    checkpoint_io.save_checkpoint(dense, tmp_path / "dense.ckpt")
    assert calls == [] and checkpoint_io.last_save_stats["chunks_compressed"] == 0
    TorchCheckpointIO().save_checkpoint(dense, tmp_path / "plain.ckpt")
    assert (tmp_path / "dense.ckpt").read_bytes() == (tmp_path / "plain.ckpt").read_bytes()
    assert not list(tmp_path.glob("*.framed"))  # no temporary file left
