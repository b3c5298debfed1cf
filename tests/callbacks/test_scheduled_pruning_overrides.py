"""ScheduledPruning's documented override points (ModelPruning-style): a subclass changes *what*, not *when*."""

from __future__ import annotations

import lightning as L

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
    pruning = KeepLastLayer(schedule="linear", target_sparsity=0.5, start_step=0, end_step=4, frequency=2,
                            parameter_names=["weight"])
    L.Trainer(max_steps=4, callbacks=[pruning], **tiny_trainer_kwargs).fit(model)
    assert pruning.events == [0.25, 0.5]  # linear, at steps 2 and 4 (a batch end is step >= 1)
    assert get_mask(model.net[4]) is None and int((model.net[4].weight == 0).sum()) == 0  # excluded: untouched
    kept = [get_mask(model.net[i]) for i in (0, 2)]
    assert sum(int((~mask).sum()) for mask in kept) == (16 * 32 + 32 * 32) // 2  # global: exactly 50% of the rest
    assert pruning.permanent_calls == 1 and kept[0] is not None  # the override ran instead of dropping the masks
