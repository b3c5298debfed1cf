"""LowMemoryFSDPStrategy with the package's callbacks: MemoryMonitor per rank, ActivationCompression and
bf16-mixed on 2 processes (one spawned run), AutoMicrobatch and cpu_offload on one."""

from __future__ import annotations

import lightning as L
import pytest
import torch

import lightning_lowmem  # noqa: F401  (registers "lowmem_fsdp")
from lightning_lowmem.callbacks import ActivationCheckpointing, ActivationCompression, AutoMicrobatch, MemoryMonitor
from lightning_lowmem.strategies.fsdp import LowMemoryFSDPStrategy
from tests.spawn import fit_saving_results
from tests.strategies.test_lowmem_fsdp import _TinyLM, _trainer


class _Save(L.Callback):
    """Each rank saves what its callbacks saw, and the dtype its first block's linear computed in."""

    def __init__(self, directory: str, monitor: MemoryMonitor, compression: ActivationCompression) -> None:
        self.directory, self.monitor, self.compression = directory, monitor, compression
        self.compute_dtypes: set = set()

    def on_train_start(self, trainer, pl_module):
        linear = pl_module.model.h[0].mlp.c_fc
        linear.register_forward_hook(lambda module, args, out: self.compute_dtypes.add(module.weight.dtype))

    def on_train_end(self, trainer, pl_module):
        torch.save(
            {
                "history": self.monitor.history,
                "own_peak": self.monitor.last_report.peak_bytes,
                "parameters_at_peak": self.monitor.last_report.breakdown["parameters"],
                "packed": self.compression.stats.packed,
                "bytes_in": self.compression.stats.bytes_in,
                "bytes_out": self.compression.stats.bytes_out,
                "compute_dtypes": sorted(str(d) for d in self.compute_dtypes),
                "master_dtypes": sorted({str(p.dtype) for p in pl_module.parameters()}),
                "weights": {k: v.clone() for k, v in trainer.strategy.full_state_dict().items()},
            },
            f"{self.directory}/rank{trainer.global_rank}.pt",
        )


@pytest.mark.slow
def test_two_processes_monitor_compression_and_bf16_mixed(tmp_path):
    torch.manual_seed(0)
    start = {k: v.clone() for k, v in _TinyLM().state_dict().items()}
    torch.manual_seed(0)
    monitor, compression = MemoryMonitor(log_every_n_steps=1, summary=False), ActivationCompression("int8", min_bytes=1)
    strategy = LowMemoryFSDPStrategy(precision="bf16-mixed", start_method="spawn")
    callbacks = [monitor, compression, _Save(str(tmp_path), monitor, compression)]
    fit_saving_results(
        lambda: _trainer(tmp_path, 2, strategy, 2, callbacks, enable_checkpointing=False).fit(_TinyLM()),
        [tmp_path / "rank0.pt", tmp_path / "rank1.pt"],
    )
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")

    # MemoryMonitor: the deep step's peak of each rank, gathered on every rank, and the largest of them
    deep = [record for record in rank0["history"] if "peak" in record]
    assert len(deep) == 1 and deep[0]["step"] == 1
    assert deep[0]["rank0/peak"] == rank0["own_peak"] and deep[0]["rank1/peak"] == rank1["own_peak"]
    assert deep[0]["peak_max"] == max(rank0["own_peak"], rank1["own_peak"])
    assert all("rss_max" in record and "rank1/rss" in record for record in rank0["history"])
    params = sum(v.numel() * 4 for v in start.values())
    assert rank0["parameters_at_peak"] < params  # sharded: half the fp32 weights + the units gathered in bf16

    # ActivationCompression packed saved activations to int8 (about a quarter of their fp32/bf16 bytes)
    for rank in (rank0, rank1):
        assert rank["packed"] > 0 and rank["bytes_out"] < 0.6 * rank["bytes_in"]

    # bf16-mixed: FSDP gathers and computes in bf16, the sharded master weights stay fp32, and they trained
    assert rank0["compute_dtypes"] == ["torch.bfloat16"] and rank0["master_dtypes"] == ["torch.float32"]
    assert all(torch.isfinite(v).all() for v in rank0["weights"].values())
    assert not torch.equal(rank0["weights"]["model.h.0.mlp.c_fc.weight"], start["model.h.0.mlp.c_fc.weight"])


def test_auto_microbatch_under_fsdp_matches_whole_batches(tmp_path):
    """Micro-batches of 2 under FSDP (each backward reduce-scatters into the sharded gradients) = batches of 8."""
    torch.manual_seed(0)
    micro, whole = _TinyLM(), _TinyLM()
    whole.load_state_dict(micro.state_dict())
    auto = AutoMicrobatch(micro_batch_size=2)
    _trainer(tmp_path, 1, LowMemoryFSDPStrategy(), 2, [auto], enable_checkpointing=False).fit(micro)
    _trainer(tmp_path, 1, LowMemoryFSDPStrategy(), 2, [], enable_checkpointing=False).fit(whole)
    assert auto.micro_batch_size == 2
    for (name, left), right in zip(micro.state_dict().items(), whole.state_dict().values(), strict=True):
        # float summation order only (lr=1e-2; a micro-batch weighted wrongly differs by ~1e-3)
        torch.testing.assert_close(left.full_tensor(), right.full_tensor(), rtol=0, atol=2e-4, msg=name)
    assert not torch.equal(
        micro.state_dict()["model.wte.weight"].full_tensor(), _TinyLM().state_dict()["model.wte.weight"]
    )


def test_cpu_offload_on_a_cpu_run_is_a_clear_error(tmp_path):
    with pytest.raises(
        ValueError, match=r"`cpu_offload`=True keeps FSDP's shards in CPU memory.*accelerator='cpu'.*drop cpu_offload"
    ):
        _trainer(tmp_path, 1, LowMemoryFSDPStrategy(cpu_offload=True), 1, [], enable_checkpointing=False).fit(_TinyLM())


def test_activation_checkpointing_names_the_users_block_class_under_fsdp(tmp_path):
    """fully_shard swaps each block's class for ``FSDPBlock``; the policy "Block" still means the user's class."""
    from torch.distributed.fsdp import FSDPModule

    model = _TinyLM()
    checkpointing = ActivationCheckpointing("Block")
    _trainer(
        tmp_path, 1, LowMemoryFSDPStrategy(wrap_policy="Block"), 2, [checkpointing], enable_checkpointing=False
    ).fit(model)
    assert isinstance(model.model.h[0], FSDPModule) and type(model.model.h[0]).__name__ == "FSDPBlock"
    assert checkpointing.wrapped == ["model.h.0", "model.h.1"]
