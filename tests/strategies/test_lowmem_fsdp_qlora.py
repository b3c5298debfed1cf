"""QLoRA under ``lowmem_fsdp``: an NF4 base sharded by FSDP2 (torchao's all-gather extension) over 2 CPU processes
(gloo), adapters trained to what one process without FSDP trains; one FSDP process refused in one line (torch's
FSDP2 skips the all-gather, and with it the extension, for a single process); the per-rank estimate counting the
NF4 shard."""

from __future__ import annotations

import lightning as L
import pytest
import torch

import lightning_lowmem  # noqa: F401  (registers "lowmem_fsdp")
from lightning_lowmem.callbacks import LowRankAdapters
from lightning_lowmem.strategies.fsdp import LowMemoryFSDPStrategy
from tests.spawn import fit_saving_results
from tests.strategies.test_lowmem_fsdp import _TinyLM, _trainer

ADAPTERS = dict(r=8, target=["c_fc"], quantize_base="nf4")


class _SaveAdapters(L.Callback):
    """Rank 0 saves the full adapters and the type of each rank's local share of an NF4 base weight."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        full = trainer.strategy.full_state_dict() if trainer.world_size > 1 else pl_module.state_dict()
        weight = pl_module.model.h[0].mlp.c_fc.weight
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        record = {
            "adapters": {k: v.float().clone() for k, v in full.items() if "lora_" in k},
            "local": (type(local).__name__, tuple(local.shape)),
        }
        torch.save(record, f"{self.directory}/rank{trainer.global_rank}.pt")


class _SGDTinyLM(_TinyLM):
    """Plain SGD: Adam's first steps on lora_A (its gradient is ~0 while lora_B starts at zero) move each entry by
    +-lr on the gradient's sign, which float rounding of another reduction order flips."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(tmp_path, devices: int, strategy) -> None:
    torch.manual_seed(0)  # the same base and adapters on every process
    callbacks = [LowRankAdapters(**ADAPTERS), _SaveAdapters(str(tmp_path))]
    trainer = _trainer(tmp_path, devices, strategy, 4, callbacks, enable_checkpointing=False, precision="bf16-true")
    trainer.fit(_SGDTinyLM())


def _reference(rank: int, directory: str) -> None:
    from pathlib import Path

    _fit(Path(directory), 1, "auto")


@pytest.mark.slow
def test_an_nf4_base_is_sharded_over_two_processes_and_trains_the_adapters_of_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    # one process, no FSDP: the reference, in a fresh process as the ranks are (the thread count and torch's
    # globals are a new process's, whatever earlier tests in this one changed). Both start from manual_seed(0) and
    # the same model draws, so the adapters start equal: this holds only while no PL_GLOBAL_SEED reaches the ranks
    # (L.seed_everything's; the ranks would re-seed at setup and draw other adapters; tests/conftest.py clears it)
    torch.multiprocessing.start_processes(_reference, args=(str(one),), nprocs=1, start_method="spawn")
    strategy = LowMemoryFSDPStrategy(start_method="spawn")
    fit_saving_results(lambda: _fit(two, 2, strategy), [two / "rank0.pt", two / "rank1.pt"])
    reference, rank0, rank1 = (
        torch.load(path / name) for path, name in ((one, "rank0.pt"), (two, "rank0.pt"), (two, "rank1.pt"))
    )
    assert reference["local"] == ("NF4Tensor", (512, 128))  # c_fc: 4 * 128 out, 128 in
    assert rank0["local"] == rank1["local"] == ("NF4Tensor", (256, 128))  # half the rows on each rank, still NF4
    assert reference["adapters"].keys() == rank0["adapters"].keys() and len(rank0["adapters"]) == 4
    for key, value in reference["adapters"].items():
        assert value.abs().sum() > 0
        # bf16 adapters, another reduction order (each rank's half-batch gradient is rounded to bf16 before the
        # reduce-scatter sums it): measured, every entry within 2 bf16 steps of the tensor's largest entry (lora_A
        # 4.9e-4 of 0.093, lora_B 2.4e-4 of 0.029) and 0.10% (lora_A) / 0.51% (lora_B) of the norm, the same with
        # 1 or 2 threads in the reference. Allowed: 1/32 of the largest entry (4-8 bf16 steps) and 2% of the norm;
        # adapters drawn from another seed differ by 1.41 of the norm, an untrained lora_B (zeros) by 1.0
        atol = value.abs().max().item() / 32
        torch.testing.assert_close(
            rank0["adapters"][key], value, rtol=0, atol=atol, msg=lambda m, key=key: f"{key}: {m}"
        )
        difference = (rank0["adapters"][key] - value).norm() / value.norm()
        assert difference < 0.02, (key, float(difference))


def test_an_nf4_base_on_one_fsdp_process_is_refused_in_one_line(tmp_path):
    with pytest.raises(
        ValueError, match=r"^FSDP on one process cannot run 2 parameter\(s\) .*NF4Tensor.*2 or more processes"
    ) as err:
        _fit(tmp_path, 1, LowMemoryFSDPStrategy())
    assert "\n" not in str(err.value)
    if torch.distributed.is_initialized():  # the refused fit's group: later estimates simulate their own
        torch.distributed.destroy_process_group()


def test_the_per_rank_estimate_counts_the_nf4_shard():
    from lightning_lowmem.planning.estimate import estimate_memory

    tokens = torch.zeros(4, 8, dtype=torch.long)
    settings = dict(device="cpu", precision="bf16-true")
    plain, nf4 = (
        estimate_memory(_TinyLM(), (tokens, tokens), lora=lora, world_size=2, sharding="fsdp", **settings)
        for lora in ({"r": 8, "target": ["c_fc"]}, ADAPTERS)
    )
    from lightning_lowmem.functional.lora.quantized_base import to_nf4_parameter

    weight = to_nf4_parameter(torch.zeros(512, 128, dtype=torch.bfloat16))  # one c_fc
    nf4_bytes = sum(getattr(weight, name).untyped_storage().nbytes() for name in weight.__tensor_flatten__()[0])
    saved = 2 * (512 * 128 * 2 - nf4_bytes)  # two blocks' c_fc: bf16 -> NF4
    # each rank holds half of each weight, NF4 or bf16, and gathers whole ones while their block computes: at least
    # the shards' saving, at most the two bf16 weights
    assert saved / 2 <= plain.breakdown["parameters"] - nf4.breakdown["parameters"] <= 2 * 512 * 128 * 2
