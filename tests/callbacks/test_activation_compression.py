"""ActivationCompression callback: packs during training, logs, releases its hooks, resumes, bad input."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_lowmem.callbacks.activation_compression import ActivationCompression
from lightning_lowmem.demo import CharLM, CharLMDataModule
from lightning_lowmem.warnings import NoEffectWarning


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops on a shared CPU run ~20x faster single-threaded (no waiting for a busy second core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class FailingCharLM(CharLM):
    """Raises inside the second training step, after its forward ran under the compression hooks."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 1:
            raise RuntimeError("boom")
        return loss


def _fit(callback, trainer_kwargs: dict, steps: int = 3, model_cls=CharLM, ckpt_path=None, **extra) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    model = model_cls(n_layer=2, n_embd=32, n_head=2, block_size=16)
    data = CharLMDataModule(block_size=16, batch_size=8, max_chars=20_000)
    kwargs = {**trainer_kwargs, **extra}
    trainer = L.Trainer(max_steps=steps, limit_val_batches=0, callbacks=[callback], log_every_n_steps=1, **kwargs)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer


def _hooks_are_released() -> bool:
    """exp saves its output; grad = saved output * 1, exact only when no pack hook is active."""
    x = torch.randn(256, 256, requires_grad=True)
    (x * 1.0).exp().sum().backward()
    return torch.equal(x.grad, x.exp())


@pytest.mark.parametrize(
    ("mode", "precision", "min_ratio"),
    [("int8", "32-true", 3.0), ("bf16", "32-true", 1.9), ("int8", "bf16-mixed", 1.8)],
)
def test_packs_during_training_logs_and_releases(tiny_trainer_kwargs, mode, precision, min_ratio):
    callback = ActivationCompression(mode=mode, min_bytes=0)
    trainer = _fit(callback, tiny_trainer_kwargs, precision=precision)
    assert callback.stats.packed > 0
    assert callback.stats.ratio >= min_ratio
    assert trainer.callback_metrics["lowmem/compression/ratio"].item() >= min_ratio
    assert trainer.callback_metrics["lowmem/compression/packed_mib"].item() > 0
    assert callback._region is None and _hooks_are_released()


def test_hooks_are_released_when_a_step_raises(tiny_trainer_kwargs):
    callback = ActivationCompression(mode="int8", min_bytes=0)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(callback, tiny_trainer_kwargs, model_cls=FailingCharLM)
    assert callback._region is None and _hooks_are_released()


def test_resume_continues_the_counts(tiny_trainer_kwargs, tmp_path):
    straight = ActivationCompression(mode="int8", min_bytes=0)
    _fit(straight, tiny_trainer_kwargs, steps=4)
    first = ActivationCompression(mode="int8", min_bytes=0)
    trainer = _fit(first, tiny_trainer_kwargs, steps=2)
    path = str(tmp_path / "step2.ckpt")
    trainer.save_checkpoint(path)
    resumed = ActivationCompression(mode="int8", min_bytes=0)
    _fit(resumed, tiny_trainer_kwargs, steps=4, ckpt_path=path)
    assert resumed.stats == straight.stats


def test_cpu_mode_on_a_cpu_device_warns(tiny_trainer_kwargs):
    callback = ActivationCompression(mode="cpu", min_bytes=0)
    with pytest.warns(NoEffectWarning, match="mode='cpu'.*CPU device"):
        _fit(callback, tiny_trainer_kwargs, steps=1)
    assert callback.stats.packed == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(mode="fp4"), ValueError, r"`mode`='fp4' is unknown; choose one of \['bf16', 'int8', 'cpu'\]"),
        (dict(min_bytes=-5), ValueError, r"`min_bytes`=-5 must be >= 0"),
        (dict(min_bytes="64KiB"), TypeError, r"`min_bytes` must be an int \(bytes\), got str"),
    ],
)
def test_bad_input_raises(kwargs, error, match):
    with pytest.raises(error, match=match):
        ActivationCompression(**kwargs)
