import lightning as L
import pytest
import torch

from lightning_lowmem.callbacks.memory_efficient_optimizer import MemoryEfficientOptimizer
from lightning_lowmem.demo.digits import DigitsClassifier, DigitsDataModule


def test_bad_name_raises():
    with pytest.raises(ValueError, match="`optimizer`='nope' is unknown"):
        MemoryEfficientOptimizer("nope")
    with pytest.raises(ValueError, match="`lr` must be a number >= 0, got -0.1"):
        MemoryEfficientOptimizer("adafactor", lr=-0.1)


@pytest.mark.parametrize("name", ["adafactor", "adamw_in_backward"])
def test_swaps_and_resumes(tmp_path, name):
    torch.manual_seed(0)
    model = DigitsClassifier()
    kw = dict(
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer = L.Trainer(callbacks=[MemoryEfficientOptimizer(name)], **kw)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model, DigitsDataModule())
    opt = trainer.optimizers[0]
    assert type(opt).__name__ == ("Adafactor" if name == "adafactor" else "OptimizerInBackward")
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert "configure_optimizers" not in model.__dict__
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    saved_state = torch.load(ckpt, weights_only=False)["optimizer_states"][0]["state"]
    assert len(saved_state) > 0
    kw["max_steps"] = 4
    trainer2 = L.Trainer(callbacks=[MemoryEfficientOptimizer(name)], **kw)
    trainer2.fit(DigitsClassifier(), DigitsDataModule(), ckpt_path=ckpt)
    step = trainer2.optimizers[0].state_dict()["state"][0]["step"]
    assert int(step) == 4


def test_bf16_true_stochastic_rounding_resume_keeps_float32_state(tmp_path):
    torch.manual_seed(0)
    kw = dict(
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        precision="bf16-true",
    )
    callback = MemoryEfficientOptimizer("adafactor_bf16_sr_in_backward", lr=0.05)
    model = DigitsClassifier()
    trainer = L.Trainer(callbacks=[callback], **kw)
    trainer.fit(model, DigitsDataModule())
    assert next(model.parameters()).dtype == torch.bfloat16
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    assert saved["param_groups"][0]["lr"] == 0.05
    first = next(iter(saved["state"].values()))
    assert all(v.dtype == torch.float32 for v in first.values() if isinstance(v, torch.Tensor))

    kw["max_steps"] = 5
    trainer2 = L.Trainer(callbacks=[MemoryEfficientOptimizer("adafactor_bf16_sr_in_backward", lr=0.05)], **kw)
    trainer2.fit(DigitsClassifier(), DigitsDataModule(), ckpt_path=ckpt)
    state = trainer2.optimizers[0].state_dict()["state"][0]
    assert int(state["step"]) == 5
    assert all(v.dtype == torch.float32 for v in state.values() if isinstance(v, torch.Tensor))


class _Scheduled(DigitsClassifier):
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def test_explicit_lr_overrides_the_group_lr_and_the_schedule_follows(tmp_path):
    trainer = L.Trainer(
        callbacks=[MemoryEfficientOptimizer("adamw", lr=0.04)],
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Scheduled(), DigitsDataModule())
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.04 * 0.5**2)  # 2 epochs of StepLR


def test_typo_fails_at_construction_with_did_you_mean():
    # failed before: accepted, then TypeError from the optimizer inside configure_optimizers
    with pytest.raises(
        ValueError,
        match=r"`betaz` is not an argument of optimizer 'adamw8bit'; did you mean 'betas'\? "
        r"'adamw8bit' accepts: lr, betas, eps, weight_decay, amsgrad, block_size",
    ):
        MemoryEfficientOptimizer("adamw8bit", betaz=(0.9, 0.99))
    with pytest.raises(ValueError, match=r"`momentum` is not an argument of optimizer 'adafactor_in_backward'"):
        MemoryEfficientOptimizer("adafactor_in_backward", momentum=0.9)
    with pytest.raises(
        ValueError, match=r"`optimizer`='adamw_8bit' is unknown; choose one of .*did you mean 'adamw8bit'\?"
    ):
        MemoryEfficientOptimizer("adamw_8bit")
    with pytest.raises(
        ValueError, match=r"`betas` must be two numbers in \[0, 1\), e.g. \[0.9, 0.999\], got \(0.9, 1.5\)"
    ):
        MemoryEfficientOptimizer("adamw8bit", betas=(0.9, 1.5))
    with pytest.raises(ValueError, match=r"OptimizerConfig\('sgd'\) refuses \{.*'nesterov': True.*Nesterov"):
        MemoryEfficientOptimizer("sgd", momentum=0.0, optimizer_kwargs={"nesterov": True})
    with pytest.raises(ValueError, match=r"`lr` is given twice \(0.1 in optimizer_kwargs, 0.2\)"):
        MemoryEfficientOptimizer("adamw", lr=0.2, optimizer_kwargs={"lr": 0.1})


def test_named_and_extra_hyperparameters_reach_the_optimizer(tmp_path):
    callback = MemoryEfficientOptimizer("adamw", betas=(0.8, 0.9), eps=1e-6, optimizer_kwargs={"amsgrad": True})
    trainer = L.Trainer(
        callbacks=[callback],
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(DigitsClassifier(), DigitsDataModule())
    group = trainer.optimizers[0].param_groups[0]
    assert (group["betas"], group["eps"], group["amsgrad"]) == ((0.8, 0.9), 1e-6, True)


def _yaml_cli(tmp_path, init_args: str):
    from lightning_lowmem.cli.lowmem_cli import lightning_cli

    config = tmp_path / "opt.yaml"
    config.write_text(
        "model:\n  class_path: lightning_lowmem.demo.DigitsClassifier\n"
        "data:\n  class_path: lightning_lowmem.demo.DigitsDataModule\n"
        "trainer:\n  callbacks:\n    - class_path: lightning_lowmem.MemoryEfficientOptimizer\n      init_args:\n"
        + "".join(f"        {line}\n" for line in init_args.strip().splitlines())
    )
    return lightning_cli(
        [
            "--config",
            str(config),
            "--trainer.fast_dev_run=true",
            "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        run=False,
    )


def test_hyperparameters_from_yaml(tmp_path):
    # failed before: `Option 'betas' is not accepted`
    cli = _yaml_cli(tmp_path, "optimizer: adamw\nbetas: [0.9, 0.99]\noptimizer_kwargs:\n  amsgrad: true\n  eps: 1.0e-6")
    callback = next(cb for cb in cli.trainer.callbacks if isinstance(cb, MemoryEfficientOptimizer))
    assert callback.optimizer_kwargs == {"amsgrad": True, "eps": 1e-6, "betas": (0.9, 0.99)}
    cli.trainer.fit(cli.model, cli.datamodule)
    group = cli.trainer.optimizers[0].param_groups[0]
    assert (tuple(group["betas"]), group["amsgrad"], group["eps"]) == ((0.9, 0.99), True, 1e-6)


def test_yaml_typo_in_optimizer_kwargs_names_the_key(tmp_path):
    with pytest.raises(
        ValueError, match=r"`betaz` is not an argument of optimizer 'adamw8bit'; did you mean 'betas'\?"
    ):
        _yaml_cli(tmp_path, "optimizer: adamw8bit\noptimizer_kwargs:\n  betaz: [0.9, 0.99]")


def test_torchao_argument_list_matches_torchao():
    import inspect

    import torchao.optim

    from lightning_lowmem.functional.optimizers.catalog import optimizer_arguments

    for name, cls in (("adamw8bit", torchao.optim.AdamW8bit), ("adamw4bit", torchao.optim.AdamW4bit)):
        assert optimizer_arguments(name) == tuple(p for p in inspect.signature(cls).parameters if p != "params")


def test_an_optimizer_config_is_taken_whole():
    from lightning_lowmem.functional.config import OptimizerConfig

    config = OptimizerConfig("adafactor", lr=0.05)
    assert MemoryEfficientOptimizer(config).config is config
    assert MemoryEfficientOptimizer(config).optimizer_kwargs == {"lr": 0.05}
    with pytest.raises(ValueError, match=r"also got \{'lr': 0.1\}: give the arguments inside the OptimizerConfig"):
        MemoryEfficientOptimizer(config, lr=0.1)
