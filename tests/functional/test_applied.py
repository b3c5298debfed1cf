"""functional.apply: one config on a module, an exact undo, the step's context and optimizer."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_lowmem.functional.applied import apply
from lightning_lowmem.functional.config import TrainingConfig


def _snapshot(module: torch.nn.Module) -> tuple:
    state = {key: value.detach().clone() for key, value in module.state_dict().items()}
    types = [(name, type(sub)) for name, sub in module.named_modules()]
    grads = [(name, p.requires_grad) for name, p in module.named_parameters()]
    forwards = [name for name, sub in module.named_modules() if "forward" in vars(sub)]
    return state, types, grads, forwards


def _assert_same(before: tuple, after: tuple) -> None:
    state, types, grads, forwards = before
    assert list(after[0]) == list(state)  # the same keys, in order
    assert all(torch.equal(after[0][key], value) for key, value in state.items())
    assert after[1:] == (types, grads, forwards)


def test_apply_then_undo_gives_the_module_back_exactly():
    from lightning_lowmem.demo import CharLM

    model = CharLM(n_layer=2, n_embd=32, n_head=2, block_size=16)
    before = _snapshot(model)
    config = TrainingConfig(
        activation_checkpointing="auto",
        activation_compression="int8",
        compression_min_bytes=0,
        lora={"r": 4, "target": ["c_attn", "c_proj"]},
        optimizer="sgd",
    )
    applied = apply(model, config)
    assert applied.checkpointed == ["model.h.0", "model.h.1"]
    assert applied.lora.wrapped and sorted(type(m).__name__ for m in model.modules()).count("LoraLinear") == 6
    assert _snapshot(model)[1] != before[1] and [n for n, p in model.named_parameters() if p.requires_grad][0].endswith(
        "lora_A"
    )

    optimizer = applied.build_optimizer()  # the config's optimizer over the adapters only
    assert type(optimizer).__name__ == "SGD" and len(optimizer.param_groups[0]["params"]) == 12
    x = torch.randint(0, 65, (2, 16))
    with applied.step_context():
        model.training_step((x, x), 0).backward()
    assert applied.compression_stats.packed > 0  # the step ran compressed

    applied.undo()
    applied.undo()  # idempotent
    _assert_same(before, _snapshot(model))


def test_undo_restores_hugging_face_use_cache_and_a_failed_apply_leaves_the_module_as_it_came():
    pytest.importorskip("transformers")
    from tests.hf_zoo import hf_module

    model = hf_module("gpt2")
    before = _snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        applied = apply(model, TrainingConfig(activation_compression="bf16", lora={"r": 2}))
        assert model.model.config.use_cache is False  # held off while compression runs
        applied.undo()
    assert model.model.config.use_cache is True
    _assert_same(before, _snapshot(model))

    with pytest.raises(ValueError, match="matched no submodule"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply(model, TrainingConfig(lora={"r": 2}, activation_checkpointing="NoSuchBlock"))  # LoRA ran first
    _assert_same(before, _snapshot(model))
    assert model.model.config.use_cache is True


def test_micro_batches_and_the_dict_form():
    applied = apply(torch.nn.Linear(3, 3), {"micro_batch_size": 2, "optimizer": "adamw"})
    parts = applied.micro_batches({"x": torch.zeros(5, 3), "scale": 2.0})
    assert [part["x"].shape[0] for part in parts] == [2, 2, 1] and parts[0]["scale"] == 2.0
    with pytest.raises(TypeError, match="`config` must be a TrainingConfig or a dict"):
        apply(torch.nn.Linear(3, 3), "adamw")


def test_reports_are_one_mapping_by_technique():
    """Each handler's report is ``applied.reports[field]`` (#35); the built-ins' attributes read the same mapping."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    applied = apply(model, {"lora": {"r": 2, "target": ["0"]}, "activation_checkpointing": "Linear"})
    assert set(applied.reports) == {"lora", "checkpointing"}
    assert applied.reports["lora"] is applied.lora and applied.lora.wrapped == ["0"]
    assert applied.reports["checkpointing"] == applied.checkpointed == ["2"]  # layer 0 is a LoraLinear now
    assert applied.quantization is None and applied.pruning is None
    applied.undo()
    assert applied.reports["checkpointing"] == []
