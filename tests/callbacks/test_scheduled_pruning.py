"""ScheduledPruning: ModelPruning migration grid, exact cubic schedule, resume, structural, DDP, bad input."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch

from tests.spawn import fit_saving_results
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning
from torch import nn
from torch.nn.utils import prune as torch_prune
from torch.utils.data import DataLoader, TensorDataset

from lightning_lowmem.callbacks.scheduled_pruning import ScheduledPruning
from lightning_lowmem.functional.pruning.unstructured import get_mask


class TinyModule(L.LightningModule):
    """16 -> 32 -> 32 -> 4 MLP on fixed random data (no shuffle: runs are exactly repeatable)."""

    def __init__(self, conv: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        if conv:
            self.net = nn.Sequential(
                nn.Conv2d(1, 8, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(8, 16, 3, padding=1),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(16, 4),
            )
        else:
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        generator = torch.Generator().manual_seed(1)
        shape = (64, 1, 4, 4) if conv else (64, 16)
        self.data = TensorDataset(
            torch.randn(shape, generator=generator), torch.randint(0, 4, (64,), generator=generator)
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=16)

    def test_dataloader(self):
        return DataLoader(self.data, batch_size=32)


def _linear_weights(module):
    return [m.weight for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def _fit(callback, kwargs, model=None, **overrides):
    model = model or TinyModule()
    trainer = L.Trainer(**{**kwargs, "max_epochs": 1, "callbacks": [callback], **overrides})
    trainer.fit(model)
    return model, trainer


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("use_global", [False, True])
@pytest.mark.parametrize("pruning_fn", ["l1_unstructured", "random_unstructured", "ln_structured", "random_structured"])
def test_migration_grid_sparsity_matches_amount(tiny_trainer_kwargs, pruning_fn, use_global, explicit):
    model = TinyModule()
    targets = [(m, "weight") for m in model.net if isinstance(m, nn.Linear)] if explicit else ()
    callback = ScheduledPruning(
        pruning_fn,
        parameters_to_prune=targets,
        parameter_names=["weight"],
        use_global_unstructured=use_global,
        amount=0.5,
        pruning_dim=0 if "structured" in pruning_fn and "unstructured" not in pruning_fn else None,
        pruning_norm=2,
        prune_heads=True,
    )
    _, trainer = _fit(callback, tiny_trainer_kwargs, model)
    trainer.test(model, verbose=False)
    weights = _linear_weights(model)
    if pruning_fn.endswith("_unstructured"):
        zeros = sum(int((w == 0).sum()) for w in weights)
        assert zeros / sum(w.numel() for w in weights) == pytest.approx(0.5, abs=1e-3)
    else:  # structured: amount is the fraction of output channels
        rows = torch.cat([(w == 0).all(dim=1) for w in weights])
        assert (
            int(rows.sum()) == round(0.5 * rows.numel())
            if use_global
            else int(rows.sum()) == sum(round(0.5 * w.shape[0]) for w in weights)
        )
    assert get_mask(model.net[0]) is None  # make_pruning_permanent (default) dropped the masks
    assert trainer.callback_metrics["test_loss"] > 0


@pytest.mark.parametrize(("pruning_fn", "use_global"), [("l1_unstructured", True), ("ln_structured", False)])
def test_same_zeros_as_lightning_model_pruning(tiny_trainer_kwargs, pruning_fn, use_global):
    args = dict(
        parameter_names=["weight"], use_global_unstructured=use_global, amount=0.5, use_lottery_ticket_hypothesis=False
    )
    if pruning_fn == "ln_structured":
        args.update(pruning_dim=0, pruning_norm=1)
    ours, _ = _fit(ScheduledPruning(pruning_fn, **args, prune_heads=True), tiny_trainer_kwargs)
    theirs, _ = _fit(ModelPruning(pruning_fn, **args), tiny_trainer_kwargs)
    for a, b in zip(_linear_weights(ours), _linear_weights(theirs), strict=True):
        assert torch.equal(a == 0, b == 0)
    # a second epoch prunes `amount` of what is left (torch.nn.utils.prune's iterative meaning): 75% in total.
    # (Masks are not compared there: ModelPruning ranks by the `weight` computed at the last forward, one step stale.)
    twice, _ = _fit(ScheduledPruning(pruning_fn, **args, prune_heads=True), tiny_trainer_kwargs, max_epochs=2)
    total = sum(w.numel() for w in _linear_weights(twice))
    zeros = sum(int((w == 0).sum()) for w in _linear_weights(twice))
    if use_global:
        assert zeros == round(0.5 * total) + round(0.5 * (total - round(0.5 * total)))
    else:
        assert zeros / total == pytest.approx(0.75, abs=0.02)


def test_torch_prune_function_and_callable_amount(tiny_trainer_kwargs):
    callback = ScheduledPruning(
        torch_prune.l1_unstructured,
        parameter_names=["weight"],
        amount=lambda epoch: 0.3 if epoch == 1 else 0.0,
        prune_heads=True,
    )
    model, _ = _fit(callback, tiny_trainer_kwargs, max_epochs=2)
    weights = _linear_weights(model)
    assert sum(int((w == 0).sum()) for w in weights) == round(0.3 * sum(w.numel() for w in weights))


def test_cubic_schedule_exact_at_every_step(tiny_trainer_kwargs):
    final, end = 0.9, 7
    num_weights = sum(w.numel() for w in _linear_weights(TinyModule()))
    seen = {}

    class Recorder(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            masks = [get_mask(m) for m in pl_module.net if isinstance(m, nn.Linear)]
            seen[trainer.global_step] = sum(int((~mask).sum()) for mask in masks)

    pruning = ScheduledPruning(
        schedule="cubic",
        target_sparsity=final,
        start_step=1,
        end_step=end,
        parameter_names=["weight"],
        make_pruning_permanent=False,
        prune_heads=True,
    )
    _fit(pruning, tiny_trainer_kwargs, max_epochs=3, callbacks=[pruning, Recorder()])
    for step, pruned in seen.items():
        t = min(step, end)
        expected = final * (1 - (1 - (t - 1) / (end - 1)) ** 3) if step >= 1 else 0.0
        assert pruned == round(expected * num_weights), step
    assert seen[max(seen)] == round(final * num_weights)


def test_logs_total_and_per_layer_sparsity(tiny_trainer_kwargs):
    from lightning.pytorch.loggers import CSVLogger

    pruning = ScheduledPruning(
        schedule="linear", target_sparsity=0.5, end_step=2, parameter_names=["weight"], prune_heads=True
    )
    _, trainer = _fit(
        pruning, tiny_trainer_kwargs, logger=CSVLogger(tiny_trainer_kwargs["default_root_dir"]), log_every_n_steps=1
    )
    assert float(trainer.callback_metrics["lowmem/sparsity/total"]) == pytest.approx(0.5, abs=1e-3)
    assert "lowmem/sparsity/net.2.weight" in trainer.callback_metrics


def test_lottery_ticket_rewinds_unpruned_weights_to_their_initial_values(tiny_trainer_kwargs):
    model = TinyModule()
    initial = [w.detach().clone() for w in _linear_weights(model)]
    _fit(
        ScheduledPruning(parameter_names=["weight"], amount=0.5, use_lottery_ticket_hypothesis=True, prune_heads=True),
        tiny_trainer_kwargs,
        model,
    )
    for weight, start in zip(_linear_weights(model), initial, strict=True):
        kept = weight != 0
        assert torch.equal(weight[kept], start[kept])


@pytest.mark.parametrize("pruning_fn", ["l1_unstructured", "random_unstructured"])
def test_resume_mid_schedule_ends_with_identical_masks_and_weights(tiny_trainer_kwargs, tmp_path, pruning_fn):
    def pruning():
        return ScheduledPruning(
            pruning_fn,
            schedule="cubic",
            target_sparsity=0.8,
            start_step=1,
            end_step=9,
            frequency=2,
            parameter_names=["weight"],
            make_pruning_permanent=False,
            prune_heads=True,
        )

    full, _ = _fit(pruning(), tiny_trainer_kwargs, max_epochs=3)  # 12 steps
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    kwargs = {**tiny_trainer_kwargs, "enable_checkpointing": True}
    _fit(pruning(), kwargs, max_epochs=1, callbacks=[pruning(), ckpt])  # "killed" after step 4 of 1..9
    path = os.path.join(tmp_path, "ckpt", os.listdir(tmp_path / "ckpt")[0])
    resumed = TinyModule()
    L.Trainer(**{**kwargs, "max_epochs": 3, "callbacks": [pruning()]}).fit(resumed, ckpt_path=path)
    for a, b in zip(full.net, resumed.net, strict=True):
        if isinstance(a, nn.Linear):
            assert torch.equal(get_mask(a), get_mask(b))
            assert torch.equal(a.weight, b.weight)


def test_nm_method_through_the_callback(tiny_trainer_kwargs):
    callback = ScheduledPruning(
        method="nm",
        n=2,
        m=4,
        schedule="constant",
        target_sparsity=0.5,
        end_step=2,
        parameter_names=["weight"],
        prune_heads=True,
    )
    model, _ = _fit(callback, tiny_trainer_kwargs)
    for weight in _linear_weights(model):
        assert ((weight.reshape(-1, 4) == 0).sum(dim=1) >= 2).all()


def test_structural_removal_rebinds_the_trainer_optimizer(tiny_trainer_kwargs):
    model = TinyModule(conv=True)
    before = sum(p.numel() for p in model.parameters())
    callback = ScheduledPruning(
        "ln_structured",
        schedule="linear",
        target_sparsity=0.5,
        end_step=4,
        structural=True,
        parameter_names=["weight"],
        use_global_unstructured=False,
        pruning_norm=2,
        prune_heads=True,
    )
    _, trainer = _fit(callback, tiny_trainer_kwargs, model, max_epochs=2)  # 8 steps: 4 after the removal
    assert model.net[0].out_channels == 4 and model.net[2].out_channels == 8
    assert sum(p.numel() for p in model.parameters()) < 0.4 * before
    opt_params = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert opt_params == {id(p) for p in model.parameters()}
    assert callback.state_dict()["structural_shapes"]["net.0.weight"] == [4, 1, 3, 3]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(amount=1.5), ValueError, r"`amount`=1.5 must be in \[0, 1\] when a float; allowed"),
        (dict(amount=-2), ValueError, r"`amount`=-2 must be >= 0 when an int"),
        (
            dict(target_sparsity=0.5, start_step=10, end_step=5),
            ValueError,
            r"`end_step`=5 must be an int > `start_step`=10",
        ),
        (
            dict(pruning_fn="l3_magic"),
            ValueError,
            r"`pruning_fn`='l3_magic' is unknown; choose one of \['l1_unstructured'",
        ),
        (dict(method="nm", n=4, m=2), ValueError, r"`n`=4, `m`=2: N:M pruning needs ints with 1 <= n < m"),
        (dict(schedule="cosine"), ValueError, r"`schedule`='cosine' is unknown; choose one of \['constant'"),
        (dict(pruning_fn=print), TypeError, r"`pruning_fn`=<built-in function print> must be one of"),
    ],
)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        ScheduledPruning(**kwargs, prune_heads=True)


def test_unknown_parameter_name_fails_at_setup(tiny_trainer_kwargs):
    with pytest.raises(
        ValueError,
        match=r"`parameter_names` contains \['kernel'\], which no module has; parameter names present: \['bias', 'weight'\]",
    ):
        _fit(ScheduledPruning(parameter_names=["kernel"], prune_heads=True), tiny_trainer_kwargs)


class _SaveMasks(L.Callback):
    """Writes each rank's masks to disk at the end of fit (before nothing is made permanent)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        masks = [get_mask(m).clone() for m in pl_module.net if isinstance(m, nn.Linear)]
        torch.save(masks, os.path.join(self.directory, f"rank{trainer.global_rank}.pt"))


def test_ddp_two_cpu_processes_have_identical_masks(tmp_path):
    pruning = ScheduledPruning(
        "random_unstructured",
        schedule="linear",
        target_sparsity=0.6,
        end_step=2,
        parameter_names=["weight"],
        make_pruning_permanent=False,
        seed=0,
        prune_heads=True,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=1,
        limit_train_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[pruning, _SaveMasks(str(tmp_path))],
    )
    fit_saving_results(lambda: trainer.fit(TinyModule()), [tmp_path / "rank0.pt", tmp_path / "rank1.pt"])
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1, strict=True))
    assert sum(int((~m).sum()) for m in rank0) == round(0.6 * sum(m.numel() for m in rank0))


def test_callable_schedule_runs_to_the_last_step_when_end_step_is_none(tiny_trainer_kwargs):
    pruning = ScheduledPruning(schedule=lambda step: 0.1 * step, parameter_names=["weight"], prune_heads=True)
    model, _ = _fit(pruning, tiny_trainer_kwargs)  # 4 steps: the last one prunes to 0.4
    assert pruning.end_step == 4
    weights = _linear_weights(model)
    assert sum(int((w == 0).sum()) for w in weights) == round(0.4 * sum(w.numel() for w in weights))
