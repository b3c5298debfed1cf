"""2-process DDP on CPU (gloo) through the registered LowMemoryDDPStrategy."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

import lightning_lowmem.strategies.low_memory  # noqa: F401  (registers "lowmem_ddp" / "lowmem_ddp_spawn")


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=generator),
                                              torch.randn(32, 1, generator=generator))
        return torch.utils.data.DataLoader(data, batch_size=4)


class _SaveWeights(L.Callback):
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        ddp_model = trainer.strategy.model
        torch.save({"weights": {k: v.clone() for k, v in pl_module.state_dict().items()},
                    "bucket_view": ddp_model.gradient_as_bucket_view},
                   f"{self.directory}/rank{trainer.global_rank}.pt")


def test_two_process_lowmem_ddp_trains_and_ranks_agree(tmp_path):
    torch.manual_seed(0)
    model = _Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="lowmem_ddp_spawn", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[_SaveWeights(str(tmp_path))])
    trainer.fit(model)
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert rank0["bucket_view"] is True and rank1["bucket_view"] is True
    assert all(torch.equal(rank0["weights"][k], rank1["weights"][k]) for k in before)  # in sync
    assert any(not torch.equal(rank0["weights"][k], before[k]) for k in before)  # and trained
