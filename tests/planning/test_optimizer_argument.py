"""``estimate_memory`` / ``plan_memory`` take their optimizer as one ``OptimizerConfig``; ``optimizer_kwargs`` is a
shorthand that builds it (deprecated beside a name), validated only by ``OptimizerConfig``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.config import OptimizerConfig, TrainingConfig
from lightning_lowmem.planning.estimate import estimate_memory
from lightning_lowmem.planning.plan import plan_memory

WIDTH = 256
PARAMETER_BYTES = (2 * WIDTH * WIDTH + 2 * WIDTH) * 4  # two Linear(256, 256), fp32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


class _AmsgradModel(nn.Sequential):
    """A module whose ``configure_optimizers`` (as a LightningModule's) returns AdamW with AMSGrad."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, amsgrad=True)


def _loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).sum()


def _estimate(model: nn.Module | None = None, **kwargs):
    return estimate_memory(model or _model(), torch.zeros(4, WIDTH), loss_fn=_loss, device="cpu", **kwargs)


def test_an_optimizer_config_estimates_what_the_old_kwargs_form_estimated():
    """AMSGrad keeps a third state tensor per parameter: its hyperparameter reaches the fake step either way."""
    plain = _estimate(optimizer="adamw")
    config = _estimate(optimizer=OptimizerConfig("adamw", amsgrad=True))
    with pytest.warns(DeprecationWarning):
        old = _estimate(optimizer="adamw", optimizer_kwargs={"amsgrad": True})
    assert config.peak_bytes == old.peak_bytes
    assert config.breakdown == old.breakdown
    assert (
        config.meta["config"] == old.meta["config"] == {**plain.meta["config"], "optimizer_kwargs": {"amsgrad": True}}
    )
    assert config.breakdown["optimizer_state"] - plain.breakdown["optimizer_state"] == PARAMETER_BYTES  # max_exp_avg_sq
    # config=TrainingConfig(...) with optimizer_kwargs beside it: the same shorthand, merged into its optimizer
    with pytest.warns(DeprecationWarning):
        merged = _estimate(config=TrainingConfig(optimizer="adamw"), optimizer_kwargs={"amsgrad": True})
    assert merged.breakdown == config.breakdown


def test_the_configured_optimizer_is_read_as_a_config_and_optimizer_kwargs_replace_its_arguments():
    """optimizer=None: configure_optimizers' AdamW(amsgrad=True) as OptimizerConfig; optimizer_kwargs win, no warning."""
    torch.manual_seed(0)
    model = _AmsgradModel(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        configured = _estimate(model)
        overridden = _estimate(model, optimizer_kwargs={"amsgrad": False})
    assert configured.breakdown == _estimate(optimizer=OptimizerConfig("adamw", lr=1e-3, amsgrad=True)).breakdown
    assert configured.meta["config"]["optimizer_kwargs"]["amsgrad"] is True
    assert overridden.breakdown == _estimate(optimizer="adamw").breakdown
    assert configured.peak_bytes - overridden.peak_bytes == PARAMETER_BYTES
    plan = plan_memory(model, torch.zeros(4, WIDTH), "1GiB", loss_fn=_loss, device="cpu", optimizer_kwargs={"lr": 0.1})
    assert plan.predicted_peak_bytes == configured.peak_bytes
    assert (plan.optimizer.name, plan.optimizer.kwargs["amsgrad"], plan.optimizer.kwargs["lr"]) == ("adamw", True, 0.1)


def test_plan_memory_plans_with_the_optimizer_config_as_with_the_old_kwargs():
    amsgrad = OptimizerConfig("adamw", amsgrad=True)
    plan = plan_memory(_model(), torch.zeros(4, WIDTH), "1GiB", loss_fn=_loss, device="cpu", optimizer=amsgrad)
    with pytest.warns(DeprecationWarning) as caught:
        old = plan_memory(
            _model(),
            torch.zeros(4, WIDTH),
            "1GiB",
            loss_fn=_loss,
            device="cpu",
            optimizer="adamw",
            optimizer_kwargs={"amsgrad": True},
        )
    assert caught[0].filename == __file__  # the warning points at the call
    assert plan.config == old.config
    assert plan.optimizer == old.optimizer == amsgrad  # the optimizer to train the plan with, hyperparameters included
    assert plan.predicted_peak_bytes == old.predicted_peak_bytes == _estimate(optimizer=amsgrad).peak_bytes
    plain = plan_memory(_model(), torch.zeros(4, WIDTH), "1GiB", loss_fn=_loss, device="cpu", optimizer="adamw")
    assert plan.predicted_peak_bytes - plain.predicted_peak_bytes == PARAMETER_BYTES
    # the per-axis prediction (the optimizer profile) sees the hyperparameters too, not only the full estimate
    assert plan.chosen.per_axis_peak_bytes - plain.chosen.per_axis_peak_bytes == PARAMETER_BYTES


def test_a_bad_hyperparameter_is_refused_with_optimizer_configs_message():
    with pytest.raises(ValueError, match=r"`betas` must be two numbers in \[0, 1\)"):
        OptimizerConfig("adamw", betas=(0.9, 1.5))
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"`betas` must be two numbers in \[0, 1\)"):
        _estimate(optimizer="adamw", optimizer_kwargs={"betas": (0.9, 1.5)})
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ValueError, match=r"`amsgard` is not an argument of optimizer 'adamw'; did you mean 'amsgrad'"),
    ):
        _estimate(optimizer="adamw", optimizer_kwargs={"amsgard": True})
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"`momentum` must be a number >= 0"):
        plan_memory(_model(), torch.zeros(4, WIDTH), "1GiB", optimizer="sgd", optimizer_kwargs={"momentum": -0.5})
    # beside optimizer=None (a plain module: AdamW), the arguments are validated the same way
    with pytest.raises(ValueError, match=r"`lr` must be a number >= 0, got -1"):
        _estimate(optimizer_kwargs={"lr": -1})


def test_the_deprecated_form_warns_and_the_ambiguous_forms_are_refused():
    with pytest.warns(
        DeprecationWarning,
        match=r"`optimizer_kwargs` beside optimizer='sgd' is deprecated: .*optimizer=OptimizerConfig\('sgd', "
        r"momentum=0\.9\)",
    ) as caught:
        _estimate(optimizer="sgd", optimizer_kwargs={"momentum": 0.9})
    assert caught[0].filename == __file__
    with pytest.raises(ValueError, match=r"`optimizer_kwargs`=\{'lr': 0\.1\} needs `optimizer` as a name"):
        _estimate(optimizer=OptimizerConfig("sgd"), optimizer_kwargs={"lr": 0.1})
    with pytest.raises(TypeError, match=r"`optimizer` must be an OptimizerConfig, an optimizer name or None, got int"):
        _estimate(optimizer=1)
    with pytest.raises(TypeError, match=r"`optimizer_kwargs`=\['lr'\] must be a mapping"):
        _estimate(optimizer_kwargs=["lr"])
