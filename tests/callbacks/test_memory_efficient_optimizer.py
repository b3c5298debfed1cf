import lightning as L
import pytest
import torch

from lightning_lowmem.callbacks.memory_efficient_optimizer import MemoryEfficientOptimizer
from lightning_lowmem.demo.digits import DigitsClassifier, DigitsDataModule


def test_bad_name_raises():
    with pytest.raises(ValueError, match="`optimizer`='nope' is unknown"):
        MemoryEfficientOptimizer("nope")


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
