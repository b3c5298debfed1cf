"""AutoMicrobatch with injected out-of-memory errors: same weights and steps as without OOM, resume, DDP."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

import lightning_lowmem.strategies.low_memory  # noqa: F401  (registers "lowmem_ddp_spawn")
from lightning_lowmem.callbacks.auto_microbatch import AutoMicrobatch, batch_size_of, slice_batch


class _OOMInBackward(torch.autograd.Function):
    """Identity whose backward raises OOM for more than ``limit`` rows (after later layers' grads exist)."""

    @staticmethod
    def forward(ctx, x, limit):
        ctx.limit = limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[0] > ctx.limit:
            raise torch.OutOfMemoryError(f"injected: {grad.shape[0]} rows > {ctx.limit}")
        return grad, None


class _Net(L.LightningModule):
    """MLP regression; raises torch.OutOfMemoryError for batches larger than ``limit`` (in forward or backward)."""

    def __init__(
        self, limit: float = float("inf"), where: str = "forward", oom_rank: int | None = None, batch_size: int = 32
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        self.limit, self.where, self.oom_rank, self.batch_size = limit, where, oom_rank, batch_size
        self.ooms = 0
        self.rows_seen: list[int] = []

    def _limit(self) -> float:
        return self.limit if self.oom_rank is None or self.global_rank == self.oom_rank else float("inf")

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.rows_seen.append(x.shape[0])
        if self.where == "forward" and x.shape[0] > self._limit():
            self.ooms += 1
            raise torch.OutOfMemoryError(f"injected: {x.shape[0]} rows")
        h = self.body(x)
        if self.where == "backward":
            h = _OOMInBackward.apply(h, self._limit())
        return nn.functional.mse_loss(self.head(h), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(
            torch.randn(64, 16, generator=generator), torch.randn(64, 1, generator=generator)
        )
        if self.trainer.world_size > 1:  # rank r takes rows r, r + world_size, ... (no shuffling)
            data = torch.utils.data.Subset(data, range(self.global_rank, 64, self.trainer.world_size))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


def _fit(tiny_trainer_kwargs, model, callbacks=(), **kwargs):
    trainer = L.Trainer(callbacks=list(callbacks), **{**tiny_trainer_kwargs, "max_steps": 4, **kwargs})
    trainer.fit(model)
    return trainer


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_close(a, b):
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_oom_retries_in_micro_batches_with_the_same_result(tiny_trainer_kwargs, where):
    reference = _Net()
    reference_trainer = _fit(tiny_trainer_kwargs, reference)

    model, callback = _Net(limit=8, where=where), AutoMicrobatch()
    trainer = _fit(tiny_trainer_kwargs, model, [callback])

    assert callback.micro_batch_size == 8  # 32 -> 16 -> 8
    assert trainer.global_step == reference_trainer.global_step == 4
    assert int(trainer.optimizers[0].state[model.head[0].weight]["step"]) == 4
    # same effective batch, so the same weights as the run that never ran out of memory
    _assert_close(_weights(model), _weights(reference))
    # later batches start at the remembered size: one forward of 32 and one of 16 failed, never again
    assert model.rows_seen[:2] == [32, 16] and set(model.rows_seen[2:]) == {8}
    # ... and the same as Lightning's own accumulation over batches of 8 in the same order
    accumulated = _Net(batch_size=8)
    _fit(tiny_trainer_kwargs, accumulated, accumulate_grad_batches=4)
    _assert_close(_weights(model), _weights(accumulated))
    # the LightningModule is restored after fit
    assert "training_step" not in model.__dict__ and "optimizer_zero_grad" not in model.__dict__


def test_uneven_split_weights_each_micro_batch_by_its_share(tiny_trainer_kwargs):
    reference = _Net(batch_size=24)
    _fit(tiny_trainer_kwargs, reference, max_steps=2)
    model, callback = _Net(limit=10, batch_size=24), AutoMicrobatch(micro_batch_size=10)  # 10 + 10 + 4
    _fit(tiny_trainer_kwargs, model, [callback], max_steps=2)
    assert model.ooms == 0 and model.rows_seen[:3] == [10, 10, 4]
    _assert_close(_weights(model), _weights(reference))


def test_oom_at_one_sample_raises_clear_error(tiny_trainer_kwargs):
    model = _Net(limit=0)
    with pytest.raises(torch.OutOfMemoryError, match="out of memory even with micro-batches of 1 sample"):
        _fit(tiny_trainer_kwargs, model, [AutoMicrobatch()])
    assert model.rows_seen == [32, 16, 8, 4, 2, 1]


def test_backward_oom_inside_accumulation_window_raises(tiny_trainer_kwargs):
    # batch 0 fits, batch 1 (not first of the window) OOMs in backward after batch 0's gradients accumulated
    class OOMOnSecondBatch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            pl_module.limit = 8 if batch_idx == 1 else float("inf")

    model = _Net(where="backward", batch_size=16)
    with pytest.raises(torch.OutOfMemoryError, match=r"batch 1, which is not the first of an accumulation window"):
        _fit(tiny_trainer_kwargs, model, [OOMOnSecondBatch(), AutoMicrobatch()], accumulate_grad_batches=2)


def test_resume_keeps_micro_batch_size(tiny_trainer_kwargs, tmp_path):
    model, callback = _Net(limit=8), AutoMicrobatch()
    trainer = _fit(tiny_trainer_kwargs, model, [callback], max_steps=2)
    assert callback.micro_batch_size == 8
    checkpoint = tmp_path / "resume.ckpt"
    trainer.save_checkpoint(checkpoint)

    resumed_model, resumed_callback = _Net(limit=8), AutoMicrobatch()
    trainer = L.Trainer(callbacks=[resumed_callback], **{**tiny_trainer_kwargs, "max_steps": 4})
    trainer.fit(resumed_model, ckpt_path=checkpoint)
    assert resumed_model.ooms == 0 and set(resumed_model.rows_seen) == {8}
    assert resumed_callback.state_dict() == {"micro_batch_size": 8}
    assert trainer.global_step == 4


def test_split_helpers_handle_collections():
    batch = {"x": torch.arange(12).view(6, 2), "y": [torch.arange(6), torch.tensor(3.0)], "name": "b"}
    assert batch_size_of(batch) == 6
    part = slice_batch(batch, 2, 5)
    assert torch.equal(part["x"], batch["x"][2:5]) and torch.equal(part["y"][0], torch.tensor([2, 3, 4]))
    assert part["y"][1] is batch["y"][1] and part["name"] == "b"
    assert part["x"].untyped_storage().data_ptr() == batch["x"].untyped_storage().data_ptr()  # a view
    with pytest.raises(ValueError, match=r"dim-0 sizes \[3, 6\]"):
        batch_size_of((torch.zeros(6), torch.zeros(3)))
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        batch_size_of({"a": 1})


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "8"])
def test_bad_micro_batch_size_raises(bad):
    with pytest.raises(ValueError, match=rf"`micro_batch_size` must be a positive int or None, got {bad!r}"):
        AutoMicrobatch(micro_batch_size=bad)


class _Manual(_Net):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_manual_optimization_is_rejected(tiny_trainer_kwargs):
    with pytest.raises(ValueError, match="AutoMicrobatch needs automatic optimization, but _Manual"):
        _fit(tiny_trainer_kwargs, _Manual(), [AutoMicrobatch()])


def test_optimizer_in_backward_is_rejected(tiny_trainer_kwargs):
    from lightning_lowmem.callbacks.memory_efficient_optimizer import MemoryEfficientOptimizer

    with pytest.raises(
        ValueError, match=r"MemoryEfficientOptimizer\(.adamw_in_backward.\) and AutoMicrobatch do not compose"
    ):
        _fit(tiny_trainer_kwargs, _Net(), [MemoryEfficientOptimizer("adamw_in_backward"), AutoMicrobatch()])


class _SaveState(L.Callback):
    def __init__(self, directory: str, auto: AutoMicrobatch) -> None:
        self.directory, self.auto = directory, auto

    def on_train_end(self, trainer, pl_module):
        torch.save(
            {
                "weights": {k: v.clone() for k, v in pl_module.state_dict().items()},
                "micro_batch_size": self.auto.micro_batch_size,
                "rows_seen": pl_module.rows_seen,
                "global_step": trainer.global_step,
            },
            f"{self.directory}/rank{trainer.global_rank}.pt",
        )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ddp_oom_on_one_rank_all_ranks_retry(tmp_path):
    # each rank gets 8 rows per step (rank r takes rows r, r+2, ...); only rank 1 runs out of memory above 4
    auto = AutoMicrobatch()
    model = _Net(limit=4, oom_rank=1, batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="lowmem_ddp_spawn",
        max_steps=3,
        logger=False,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[auto, _SaveState(str(tmp_path), auto)],
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert rank0["micro_batch_size"] == rank1["micro_batch_size"] == 4  # agreed, though rank 0 never OOMed
    assert rank0["global_step"] == rank1["global_step"] == 3
    assert rank1["rows_seen"][:1] == [8] and set(rank1["rows_seen"][1:]) == {4}
    _assert_close(rank0["weights"], rank1["weights"])  # in sync
    # DDP averages the two ranks' mean gradients: the same as one process on batches of 16 in order
    reference = _Net(batch_size=16)
    L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    ).fit(reference)
    _assert_close(rank0["weights"], _weights(reference))
