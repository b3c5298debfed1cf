"""ScheduledPruning's documented override points (ModelPruning-style): a subclass changes *what*, not *when*."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_lowmem.callbacks.scheduled_pruning import ScheduledPruning
from lightning_lowmem.functional.pruning.masks import get_mask
from tests.callbacks.test_scheduled_pruning import TinyModule


class KeepLastLayer(ScheduledPruning):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.events: list[float] = []
        self.permanent_calls = 0

    def resolve_targets(self, pl_module):
        return [target for target in super().resolve_targets(pl_module) if target[0] != "net.4"]

    def apply_pruning(self, pl_module, amount, *, relative, generator):
        self.events.append(amount)
        return super().apply_pruning(pl_module, amount, relative=relative, generator=generator)

    def make_pruning_permanent(self, pl_module):
        self.permanent_calls += 1  # keep the masks: nothing removed


def test_overridden_targets_and_pruning_hooks_are_used_at_each_event(tiny_trainer_kwargs):
    model = TinyModule()
    pruning = KeepLastLayer(
        schedule="linear", target_sparsity=0.5, start_step=0, end_step=4, frequency=2, parameter_names=["weight"]
    )
    L.Trainer(max_steps=4, callbacks=[pruning], **tiny_trainer_kwargs).fit(model)
    assert pruning.events == [0.25, 0.5]  # linear, at steps 2 and 4 (a batch end is step >= 1)
    assert get_mask(model.net[4]) is None and int((model.net[4].weight == 0).sum()) == 0  # excluded: untouched
    kept = [get_mask(model.net[i]) for i in (0, 2)]
    assert sum(int((~mask).sum()) for mask in kept) == (16 * 32 + 32 * 32) // 2  # global: exactly 50% of the rest
    assert pruning.permanent_calls == 1 and kept[0] is not None  # the override ran instead of dropping the masks


class TwoInputModule(TinyModule):
    """``forward(x, shift)``, called through the documented override point ``forward_batch(batch)``."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(2)
        x, y = self.data.tensors
        self.data = TensorDataset(x, torch.randn(64, 16, generator=generator), y)

    def forward(self, x, shift):
        return self.net(x + shift)

    def forward_batch(self, batch):
        return self(batch[0], batch[1])

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.forward_batch(batch), batch[2])


def test_structural_pruning_traces_through_forward_batch(tiny_trainer_kwargs):
    model = TwoInputModule()
    pruning = ScheduledPruning("ln_structured", schedule="linear", target_sparsity=0.5, end_step=2, structural=True)
    L.Trainer(max_steps=2, callbacks=[pruning], **tiny_trainer_kwargs).fit(model)  # was: TypeError (shift missing)
    assert pruning.structural_done
    assert (model.net[0].out_features, model.net[2].in_features, model.net[2].out_features) == (16, 16, 16)
    assert model(torch.randn(3, 16), torch.zeros(3, 16)).shape == (3, 4)
