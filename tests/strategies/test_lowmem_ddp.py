"""LowMemoryDDPStrategy on CPU (gloo): ZeRO-1 across 2 processes, resuming on 1, bucket-view gradients."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import lightning_lowmem  # noqa: F401  (registers "lowmem", "lowmem_ddp", "lowmem_ddp_spawn")
from lightning_lowmem.memory import state_bytes
from lightning_lowmem.strategies.low_memory import LowMemoryDDPStrategy
from lightning_lowmem.warnings import LowMemWarning

GLOBAL_BATCH = 8


class _Balanced(L.LightningModule):
    """Four equal 32x32 layers, so ZeRO's greedy partition gives each of 2 ranks exactly half."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]  # per epoch

    def train_dataloader(self):
        # the same global batches on any world size: rank r takes every world_size-th sample
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(16, 32, generator=generator), torch.randn(16, 32, generator=generator)
        )
        world_size, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
        return torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)


BUCKETS: dict[int, int] = {}  # this process's DDP gradient buckets: storage data pointer -> bytes


def _recording_allreduce(state, bucket):
    """DDP communication hook: note the bucket's storage, then all-reduce as DDP would."""
    storage = bucket.buffer().untyped_storage()
    BUCKETS[storage.data_ptr()] = storage.nbytes()
    return default_hooks.allreduce_hook(state, bucket)


class _WatchBuckets(L.Callback):
    """Registers the recording hook on the DDP model (Lightning registers `ddp_comm_hook` on CUDA only)."""

    def on_train_start(self, trainer, pl_module):
        BUCKETS.clear()
        if isinstance(trainer.strategy.model, nn.parallel.DistributedDataParallel):
            trainer.strategy.model.register_comm_hook(None, _recording_allreduce)


class _Record(_WatchBuckets):
    """Each rank saves its final weights, its optimizer-state bytes and how gradients are stored."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.grads_in_buckets: bool | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.grads_in_buckets is None and trainer.world_size > 1:
            self.grads_in_buckets = all(p.grad.untyped_storage().data_ptr() in BUCKETS for p in pl_module.parameters())

    def on_train_end(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        torch.save(
            {
                "weights": {k: v.clone() for k, v in pl_module.state_dict().items()},
                "optimizer_type": type(optimizer).__name__,
                "optimizer_state_bytes": state_bytes(optimizers=[optimizer])["optimizer_state"],
                "grads_in_buckets": self.grads_in_buckets,
            },
            f"{self.directory}/rank{trainer.global_rank}.pt",
        )


def _trainer_kwargs(tmp_path, **kwargs):
    return dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=str(tmp_path),
        **kwargs,
    )


@pytest.mark.slow
def test_zero1_two_processes_shard_state_and_resume_on_one(tmp_path):
    torch.manual_seed(0)
    model = _Balanced()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = LowMemoryDDPStrategy(zero_optimizer=True, start_method="spawn")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    trainer = L.Trainer(
        devices=2,
        strategy=strategy,
        max_epochs=2,
        callbacks=[_Record(str(tmp_path)), checkpoints],
        **_trainer_kwargs(tmp_path / "two"),
    )
    trainer.fit(model)
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")

    # trains, ranks agree, optimizer is sharded: each rank holds half of the optimizer state
    assert rank0["optimizer_type"] == "ZeroRedundancyOptimizer"
    assert all(torch.equal(rank0["weights"][k], rank1["weights"][k]) for k in initial)
    assert any(not torch.equal(rank0["weights"][k], initial[k]) for k in initial)
    assert rank0["grads_in_buckets"] is True and rank1["grads_in_buckets"] is True

    # the epoch-1 checkpoint holds the full (consolidated) state and resumes on 1 process, plain "lowmem"
    first_epoch = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert len(torch.load(first_epoch, weights_only=False)["optimizer_states"][0]["state"]) == len(initial)
    resumed_model = _Balanced()
    resumed = L.Trainer(
        devices=1,
        strategy="lowmem",
        max_epochs=2,
        callbacks=[_Record(str(tmp_path / "one"))],
        enable_checkpointing=False,
        **_trainer_kwargs(tmp_path / "one"),
    )
    (tmp_path / "one").mkdir(exist_ok=True)
    resumed.fit(resumed_model, ckpt_path=first_epoch)
    single = torch.load(tmp_path / "one" / "rank0.pt")
    assert single["optimizer_type"] == "AdamW"
    for k in initial:  # same weights as the 2-process run's second epoch (sum order differs: allclose)
        torch.testing.assert_close(single["weights"][k], rank0["weights"][k], rtol=1e-5, atol=1e-6)

    full = single["optimizer_state_bytes"]  # measured by the memory core on the unsharded optimizer
    assert rank0["optimizer_state_bytes"] + rank1["optimizer_state_bytes"] == full
    assert 0.45 * full <= rank0["optimizer_state_bytes"] <= 0.55 * full


@pytest.mark.parametrize("bucket_view", [True, False])
def test_gradients_are_views_into_ddp_buckets(tmp_path, bucket_view):
    """One in-process DDP rank: with bucket views the gradients *are* the buckets (1x the parameters);
    without, gradients and buckets are separate copies (2x)."""
    seen = {}

    class Check(_WatchBuckets):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if seen:
                return
            params = list(pl_module.parameters())
            grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in params}
            seen["memory_core"] = state_bytes(pl_module)
            seen["grads_in_buckets"] = all(ptr in BUCKETS for ptr in grads)
            seen["grad_and_bucket_bytes"] = sum({**grads, **BUCKETS}.values())

    kwargs = {} if bucket_view else {"gradient_as_bucket_view": False}
    trainer = L.Trainer(
        devices=1,
        strategy=LowMemoryDDPStrategy(**kwargs),
        max_steps=1,
        callbacks=[Check()],
        enable_checkpointing=False,
        **_trainer_kwargs(tmp_path),
    )
    trainer.fit(_Balanced())
    params = seen["memory_core"]["parameters"]
    assert seen["memory_core"]["gradients"] == params  # the memory core counts each gradient storage once
    assert seen["grads_in_buckets"] is bucket_view
    assert seen["grad_and_bucket_bytes"] == (1 if bucket_view else 2) * params


def test_zero_with_one_process_warns_and_keeps_the_plain_optimizer(tmp_path):
    trainer = L.Trainer(
        devices=1,
        strategy=LowMemoryDDPStrategy(zero_optimizer=True),
        max_steps=1,
        enable_checkpointing=False,
        **_trainer_kwargs(tmp_path),
    )
    with pytest.warns(LowMemWarning, match=r"world_size=1: zero_optimizer=True needs a distributed run.*falling back"):
        trainer.fit(_Balanced())
    assert type(trainer.optimizers[0]) is torch.optim.AdamW
