"""ActivationCheckpointing callback: identical training, bf16-mixed, DDP, undo on teardown, resume, bad input."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_lowmem.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_lowmem.demo import CharLM, CharLMDataModule
from lightning_lowmem.functional.checkpointing import checkpointed_modules
from lightning_lowmem.warnings import LowMemWarning, NoEffectWarning


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops on a shared CPU run ~20x faster single-threaded (no waiting for a busy second core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fit(
    callbacks: list, trainer_kwargs: dict, steps: int = 3, ckpt_path: str | None = None, **extra
) -> tuple[CharLM, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = CharLM(n_layer=2, n_embd=32, n_head=2, block_size=16, dropout=0.1)
    data = CharLMDataModule(block_size=16, batch_size=4, max_chars=20_000)
    kwargs = {**trainer_kwargs, **extra}
    trainer = L.Trainer(max_steps=steps, limit_val_batches=0, callbacks=callbacks, **kwargs)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_training_is_identical_and_undone_on_teardown(tiny_trainer_kwargs, precision):
    base, _ = _fit([], tiny_trainer_kwargs, precision=precision)
    callback = ActivationCheckpointing(policy="auto")
    model, _ = _fit([callback], tiny_trainer_kwargs, precision=precision)
    assert callback.wrapped == ["model.h.0", "model.h.1"]
    assert checkpointed_modules(model) == []  # teardown undid the wrap
    for (name, a), b in zip(model.named_parameters(), base.parameters(), strict=True):
        assert torch.equal(a, b), name  # same weights bit for bit, dropout included


def test_nested_policy_trains_identically(tiny_trainer_kwargs):
    base, _ = _fit([], tiny_trainer_kwargs, steps=2)
    callback = ActivationCheckpointing(policy=["Block", "*.attn"], nested=True)
    model, _ = _fit([callback], tiny_trainer_kwargs, steps=2)
    assert callback.wrapped == ["model.h.0", "model.h.0.attn", "model.h.1", "model.h.1.attn"]
    assert callback.state_dict()["nested"] is True
    for a, b in zip(model.parameters(), base.parameters(), strict=True):
        assert torch.equal(a, b)


def test_ddp_wraps_before_the_strategy_and_trains_identically(tiny_trainer_kwargs):
    # in-process DDP (world size 1) keeps this fast; a 2-process ddp_spawn run also gives equal weights
    # but costs ~80 s on a shared 2-core machine
    kwargs = {**tiny_trainer_kwargs, "devices": 1, "strategy": "ddp"}
    base, _ = _fit([], kwargs, steps=2)
    model, _ = _fit([ActivationCheckpointing(policy="Block")], kwargs, steps=2)
    for a, b in zip(model.parameters(), base.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resume_restores_state_and_warns_on_a_different_wrap(tiny_trainer_kwargs, tmp_path):
    kwargs = {**tiny_trainer_kwargs, "enable_checkpointing": True, "default_root_dir": str(tmp_path)}
    callback = ActivationCheckpointing(policy=2)
    _, trainer = _fit([callback], kwargs, steps=2)
    path = str(tmp_path / "step2.ckpt")
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["callbacks"][callback.state_key]["wrapped"] == ["model.h.0"]
    with pytest.warns(LowMemWarning, match=r"trained with modules \['model.h.0'\] wrapped"):
        model, _ = _fit([ActivationCheckpointing(policy="Block")], kwargs, steps=3, ckpt_path=path)
    assert checkpointed_modules(model) == []


def test_policy_matching_nothing_stops_fit_with_the_class_names(tiny_trainer_kwargs):
    with pytest.raises(ValueError, match=r"'Blok' matched no submodule of CharLM\. Did you mean 'Block'\?"):
        _fit([ActivationCheckpointing(policy="Blok")], tiny_trainer_kwargs, steps=1)


def test_policy_matching_nothing_warns_when_not_strict(tiny_trainer_kwargs):
    callback = ActivationCheckpointing(policy="Conv9d", strict=False)
    with pytest.warns(NoEffectWarning, match="'Conv9d' matched no submodule of CharLM"):
        _fit([callback], tiny_trainer_kwargs, steps=1)
    assert callback.wrapped == []


@pytest.mark.parametrize(
    ("policy", "error", "match"),
    [
        (0, ValueError, r"`policy`=0 must be >= 1"),
        (2.5, TypeError, r"`policy`=2.5 \(float\)"),
        ("", ValueError, "empty"),
    ],
)
def test_bad_policy_raises_at_construction(policy, error, match):
    with pytest.raises(error, match=match):
        ActivationCheckpointing(policy=policy)


def test_bad_nested_raises_at_construction():
    with pytest.raises(TypeError, match="`nested` must be True or False, got int: 1"):
        ActivationCheckpointing(policy="Block", nested=1)


class LazyCharLM(CharLM):
    """Builds its network in ``configure_model`` (as large-model code does), not in ``__init__``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        del self.model

    def configure_model(self) -> None:
        from lightning_lowmem.demo.charlm import CharGPT

        if not hasattr(self, "model"):
            self.model = CharGPT(self.config)


def test_finds_layers_built_in_configure_model(tiny_trainer_kwargs):
    callback = ActivationCheckpointing(policy="auto")
    model = LazyCharLM(n_layer=2, n_embd=32, n_head=2, block_size=16)
    trainer = L.Trainer(max_steps=1, limit_val_batches=0, callbacks=[callback], **tiny_trainer_kwargs)
    trainer.fit(model, CharLMDataModule(block_size=16, batch_size=4, max_chars=20_000))
    assert callback.wrapped == ["model.h.0", "model.h.1"]
    assert checkpointed_modules(model) == []
