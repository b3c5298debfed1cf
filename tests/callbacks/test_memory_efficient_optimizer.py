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
    kw = dict(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=0, default_root_dir=tmp_path)
    trainer = L.Trainer(callbacks=[MemoryEfficientOptimizer(name)], **kw)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model, DigitsDataModule())
    opt = trainer.optimizers[0]
    assert type(opt).__name__ == ("Adafactor" if name == "adafactor" else "OptimizerInBackward")
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
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
    kw = dict(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=0, default_root_dir=tmp_path, precision="bf16-true")
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
    trainer = L.Trainer(callbacks=[MemoryEfficientOptimizer("adamw", lr=0.04)], max_epochs=2, limit_train_batches=2,
                        limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(_Scheduled(), DigitsDataModule())
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.04 * 0.5**2)  # 2 epochs of StepLR
