"""A fit that fails before training changes nothing (issue #34 item 2): whatever our callbacks and the low-memory
strategy applied in that fit is undone, last change first, and a later fit of the same module trains as if the
failed one never ran.

The matrix: every technique callback (and ``LowMemoryStrategy``) as the one applied earlier, every one as the one
that fails, in ``setup`` or in ``on_fit_start``; after the failure the weights are bit-identical, ``requires_grad``
and the module types as before, and no method of the module is left wrapped.
"""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_lowmem import ActivationCheckpointing, ChunkedCrossEntropy, LowRankAdapters
from lightning_lowmem.composition import refusal, techniques_of
from lightning_lowmem.strategies import LowMemoryStrategy

from tests.callbacks.test_composition import SWITCHES, BlocksModule

warnings.filterwarnings("ignore", module="torchao")

CALLBACKS = [name for name, switch in SWITCHES.items() if not isinstance(switch, dict)]
EARLIER = [*CALLBACKS, "strategy"]


class Injected(RuntimeError):
    """The failure the test injects."""


def _failing(callback: L.Callback, hook: str) -> L.Callback:
    """``callback`` whose ``hook`` does its work, then raises."""
    original = getattr(callback, hook)

    def failing(*args, **kwargs):
        original(*args, **kwargs)
        raise Injected(f"{type(callback).__name__}.{hook} failed")

    setattr(callback, hook, failing)
    return callback


def _state(module: torch.nn.Module) -> dict:
    return {
        "weights": {key: value.detach().clone() for key, value in module.state_dict().items()},
        "requires_grad": {name: p.requires_grad for name, p in module.named_parameters()},
        "types": [(name, type(sub)) for name, sub in module.named_modules()],
        "wrapped": sorted(name for name in vars(module) if callable(vars(module)[name])),
        "strict_loading": module.strict_loading,
    }


def _assert_as_before(module: torch.nn.Module, before: dict) -> None:
    after = _state(module)
    assert after["types"] == before["types"]
    assert after["requires_grad"] == before["requires_grad"]
    assert after["wrapped"] == before["wrapped"]  # training_step / configure_optimizers not left wrapped
    assert after["strict_loading"] == before["strict_loading"]
    assert after["weights"].keys() == before["weights"].keys()  # no adapter, mask or quantized layer left
    for key, value in before["weights"].items():
        assert type(after["weights"][key]) is torch.Tensor and torch.equal(after["weights"][key], value), key


def _strategy() -> LowMemoryStrategy:
    return LowMemoryStrategy(activation_checkpointing="Block")


def _composes(names: list[str]) -> bool:
    """The pair gets past ``Trainer()`` (one instance per callback class) and the composition check."""
    callbacks = [SWITCHES[name]() for name in names if name != "strategy"]
    strategy = _strategy() if "strategy" in names else None
    trainer = SimpleNamespace(callbacks=callbacks, strategy=strategy, accumulate_grad_batches=1, gradient_clip_val=0)
    one_each = len({type(callback) for callback in callbacks}) == len(callbacks)
    return one_each and refusal(techniques_of(trainer)) is None


def _cases() -> list[tuple[str, str, str]]:
    return [
        (earlier, failing, hook)
        for earlier in EARLIER
        for failing in CALLBACKS
        for hook in ("setup", "on_fit_start")
        if earlier != failing and _composes([earlier, failing])
    ]


@pytest.mark.parametrize(("earlier", "failing", "hook"), _cases(), ids=["-".join(case) for case in _cases()])
def test_a_failure_before_training_undoes_every_change(earlier, failing, hook, tiny_blocks, tiny_trainer_kwargs):
    module = BlocksModule(tiny_blocks)
    before = _state(module)
    callbacks = [] if earlier == "strategy" else [SWITCHES[earlier]()]
    callbacks.append(_failing(SWITCHES[failing](), hook))
    strategy = _strategy() if earlier == "strategy" else "auto"
    trainer = L.Trainer(max_steps=2, limit_val_batches=0, callbacks=callbacks, strategy=strategy, **tiny_trainer_kwargs)
    with pytest.raises(Injected):
        trainer.fit(module)
    _assert_as_before(module, before)


@pytest.mark.parametrize("earlier", EARLIER)
def test_the_strategy_failing_undoes_the_callbacks(earlier, tiny_blocks, tiny_trainer_kwargs):
    """The strategy fails in its setup (a checkpointing policy that matches nothing), after the callbacks' setup."""
    module = BlocksModule(tiny_blocks)
    before = _state(module)
    callbacks = [] if earlier == "strategy" else [SWITCHES[earlier]()]
    trainer = L.Trainer(
        max_steps=2,
        limit_val_batches=0,
        callbacks=callbacks,
        strategy=LowMemoryStrategy(activation_checkpointing="NoSuchBlock"),
        **tiny_trainer_kwargs,
    )
    with pytest.raises(ValueError, match="NoSuchBlock"):
        trainer.fit(module)
    _assert_as_before(module, before)


def _trained(module: BlocksModule, tiny_trainer_kwargs: dict, callbacks: list) -> dict:
    trainer = L.Trainer(max_steps=2, limit_val_batches=0, callbacks=callbacks, **tiny_trainer_kwargs)
    trainer.fit(module)
    return {key: value.detach().clone() for key, value in module.state_dict().items()}


def test_the_issue_example_a_later_fit_trains_every_parameter(tiny_blocks, tiny_trainer_kwargs):
    """Issue #34: LoRA wrapped and froze the model, then a checkpointing policy typo stopped the fit; the next fit
    of the same module, without LoRA, trained 16,384 of 3,997,248 parameters. Now it trains them all, exactly as
    a module that never saw the failed fit."""
    module = BlocksModule(tiny_blocks)
    untouched = copy.deepcopy(module)
    start = {key: value.clone() for key, value in module.state_dict().items()}
    failed = L.Trainer(
        max_steps=2,
        limit_val_batches=0,
        callbacks=[LowRankAdapters(r=2), ChunkedCrossEntropy(head="model.head"), ActivationCheckpointing("NoBlock")],
        **tiny_trainer_kwargs,
    )
    with pytest.raises(ValueError, match="NoBlock"):
        failed.fit(module)
    total = sum(p.numel() for p in module.parameters())
    assert sum(p.numel() for p in module.parameters() if p.requires_grad) == total
    after = _trained(module, tiny_trainer_kwargs, [ActivationCheckpointing("Block")])
    expected = _trained(untouched, tiny_trainer_kwargs, [ActivationCheckpointing("Block")])
    assert after.keys() == expected.keys()
    assert all(torch.equal(after[key], expected[key]) for key in expected)
    assert all(not torch.equal(after[key], start[key]) for key in start)  # every tensor trained


def test_a_failure_after_training_started_keeps_the_adapters(tiny_blocks, tiny_trainer_kwargs):
    """Committed at train start: a later failure keeps LoRA's adapters (the trained result), as before."""
    module = BlocksModule(tiny_blocks)
    lora = _failing(LowRankAdapters(r=2), "on_train_batch_end")
    trainer = L.Trainer(max_steps=2, limit_val_batches=0, callbacks=[lora], **tiny_trainer_kwargs)
    with pytest.raises(Injected):
        trainer.fit(module)
    assert type(module.model.stem).__name__ == "LoraLinear"
