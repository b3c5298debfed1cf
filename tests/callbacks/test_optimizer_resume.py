"""Every optimizer name resumes bit-identically through `fit(ckpt_path=...)`, and checkpoints of one optimizer
refuse to load into another (or into a Trainer without `MemoryEfficientOptimizer`) with a message saying what to add.

One tiny model (a 64x64 weight: 4096 elements, quantized by torchao's 8-/4-bit AdamW, and a 64-element bias:
kept in float32) and four steps. torchao compiles its per-parameter step on first use, which takes tens of
seconds on CPU; the resume tests run it eagerly (`torch.compiler.set_stance("force_eager")`): what they test is
the state that is saved and loaded, the same either way. `test_optimizers.py` runs the compiled step.
"""

from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_lowmem._compat.compiler import force_eager
from lightning_lowmem.callbacks.memory_efficient_optimizer import MemoryEfficientOptimizer
from lightning_lowmem.checkpoints import CheckpointMismatchError, records
from lightning_lowmem.functional.optimizers.catalog import available_optimizers


class _Net(L.LightningModule):
    """A 64 -> 64 linear layer fitted to fixed targets: no randomness, so two runs can be compared bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(64, 64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(torch.tanh(self.layer(x)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)  # plain torch: swapped by the callback

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(16, 64, generator=generator), torch.rand(16, 64, generator=generator)
        )
        return torch.utils.data.DataLoader(data, batch_size=8)  # 2 steps per epoch, fixed order


def _trainer(tmp_path, callbacks, max_epochs, **kwargs):
    return L.Trainer(
        max_epochs=max_epochs,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        **kwargs,
    )


def _fit_two_epochs_saving_the_first(tmp_path, name, **kwargs):
    """Uninterrupted 2-epoch run that leaves its end-of-epoch-1 checkpoint behind: (model, checkpoint path)."""
    model = _Net()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    callbacks = [MemoryEfficientOptimizer(name, **kwargs), saver] if name else [saver]
    _trainer(tmp_path, callbacks, max_epochs=2).fit(model)
    return model, tmp_path / "ckpt" / "epoch=0-step=2.ckpt"


@contextlib.contextmanager
def _no_safe_globals():
    """As in a fresh process where torchao was never imported: no tensor subclass is allowed in a weights-only load."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        torch.serialization.add_safe_globals(saved)


@pytest.mark.parametrize("name", available_optimizers())
def test_every_optimizer_resumes_bit_identically(tmp_path, name):
    with force_eager():
        uninterrupted, path = _fit_two_epochs_saving_the_first(tmp_path, name)
        with _no_safe_globals():  # failed before: Unsupported global torchao.optim.subclass_8bit.OptimState8bit
            saved = torch.load(path, weights_only=True, map_location=lambda storage, _: storage)  # Lightning's callable
        assert records(saved)["MemoryEfficientOptimizer"]["format"] == name
        resumed = _Net()
        trainer = _trainer(tmp_path / "resumed", [MemoryEfficientOptimizer(name)], max_epochs=2)
        trainer.fit(resumed, ckpt_path=path)
    assert trainer.global_step == 4
    for (key, a), b in zip(uninterrupted.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name}: {key} differs after resume"
    assert not torch.equal(resumed.layer.weight, _Net().layer.weight)  # it trained


def test_low_bit_state_is_saved_as_plain_uint8_codes(tmp_path):
    with force_eager():
        _, path = _fit_two_epochs_saving_the_first(tmp_path, "adamw4bit_in_backward")
    state = torch.load(path, weights_only=True)["optimizer_states"][0]["state"]
    weight_state, bias_state = state[0], state[1]
    codes = weight_state["exp_avg"]["tensors"]["codes"]
    assert codes.dtype == torch.uint8 and codes.numel() == 4096 // 2  # 4-bit: two codes a byte
    assert bias_state["exp_avg"].dtype == torch.float32  # under 4096 elements: torchao keeps float32


def test_in_backward_checkpoint_into_a_plain_trainer_names_the_callback(tmp_path):
    with force_eager():
        _, path = _fit_two_epochs_saving_the_first(tmp_path, "adamw_in_backward")
    # failed before: KeyError: 'betas' in the first step of the plain AdamW
    with pytest.raises(
        ValueError,
        match=r"written by MemoryEfficientOptimizer\('adamw_in_backward'\).*add "
        r"callbacks=\[MemoryEfficientOptimizer\('adamw_in_backward'\)\]",
    ):
        _trainer(tmp_path / "plain", [], max_epochs=2).fit(_Net(), ckpt_path=path)


def test_adamw_state_into_adafactor_fails_before_loading(tmp_path):
    _, path = _fit_two_epochs_saving_the_first(tmp_path, None)  # plain AdamW, nothing recorded
    model = _Net()
    trainer = _trainer(tmp_path / "adafactor", [MemoryEfficientOptimizer("adafactor")], max_epochs=2)
    # failed before: loaded silently, then AssertionError: row_var and col_var should be defined
    with pytest.raises(
        ValueError,
        match=r"does not fit optimizer 'adafactor': parameter 0 holds "
        r"\['exp_avg', 'exp_avg_sq', 'step'\] \(adam state\)",
    ):
        trainer.fit(model, ckpt_path=path)
    assert trainer.global_step == 0


def test_another_memory_efficient_optimizer_refuses_before_the_weights_load(tmp_path):
    with force_eager():
        _, path = _fit_two_epochs_saving_the_first(tmp_path, "adamw8bit")
    model = _Net()
    before = model.layer.weight.detach().clone()
    with pytest.raises(
        CheckpointMismatchError,
        match=r"MemoryEfficientOptimizer \(format 'adamw8bit', version 1\): "
        r"its AdamW state in 8-bit cannot be continued by this Trainer's MemoryEfficientOptimizer\('adamw'\)",
    ):
        _trainer(tmp_path / "other", [MemoryEfficientOptimizer("adamw")], max_epochs=2).fit(model, ckpt_path=path)
    assert torch.equal(model.layer.weight, before)  # nothing applied


def test_same_state_layout_resumes_across_names(tmp_path):
    with force_eager():
        uninterrupted, path = _fit_two_epochs_saving_the_first(tmp_path, "adamw8bit")
        resumed = _Net()
        _trainer(tmp_path / "ib", [MemoryEfficientOptimizer("adamw8bit_in_backward")], max_epochs=2).fit(
            resumed, ckpt_path=path
        )
    assert torch.equal(resumed.layer.weight, uninterrupted.layer.weight)
