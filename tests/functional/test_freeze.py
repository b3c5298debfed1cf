"""The freeze technique (`FreezeConfig`, its registered handler): what it freezes, its undo, LoRA and pruning beside
it, and the estimator / planner counting its memory effect."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem.demo import CharLM
from lightning_lowmem.functional import TrainingConfig, apply
from lightning_lowmem.functional.config import LoRAConfig, PruningConfig
from lightning_lowmem.functional.techniques.freeze import FreezeConfig, freeze_layers_, frozen_modules
from lightning_lowmem.functional.lora.adapters import lora_layers
from lightning_lowmem.planning.estimate import estimate_memory
from lightning_lowmem.planning.plan import plan_memory
from tests.hf_zoo import hf_module
from tests.planning.test_estimate import _real_peak


def _charlm(n_layer: int = 3) -> CharLM:
    torch.manual_seed(0)
    return CharLM(n_layer=n_layer, n_head=2, n_embd=32, block_size=16)


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"blocks": -1}, ValueError, r"`blocks`=-1 must be an int >= 0.*e\.g\. 2"),
        ({"blocks": 1.5}, ValueError, r"`blocks`=1\.5 must be an int >= 0"),
        ({"blocks": True}, ValueError, r"`blocks`=True must be an int >= 0"),
        ({"embeddings": "yes"}, TypeError, r"`embeddings`='yes' must be True or False"),
        ({"blocks": 0, "embeddings": False}, ValueError, r"freeze nothing; freeze at least one block"),
    ],
)
def test_config_errors(arguments, error, match):
    with pytest.raises(error, match=match):
        FreezeConfig(**arguments)


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("gpt2", ["model.transformer.wte", "model.transformer.wpe", "model.transformer.h.0"]),
        ("llama", ["model.model.embed_tokens", "model.model.layers.0"]),
    ],
)
def test_the_exact_frozen_set_of_hf_models(family, expected):
    module = hf_module(family)
    applied = apply(module, FreezeConfig(blocks=1))
    assert applied.reports["freeze_layers"] == expected
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    assert frozen == {f"{name}.{p}" for name in expected for p, _ in module.get_submodule(name).named_parameters()}
    applied.undo()
    assert all(p.requires_grad for p in module.parameters())
    assert not any("_lowmem_frozen" in m.__dict__ for m in module.modules())


def test_the_charlm_blocks_only_and_too_many_blocks():
    model = _charlm()
    assert frozen_modules(model, FreezeConfig(blocks=2, embeddings=False)) == ["model.h.0", "model.h.1"]
    assert freeze_layers_(model, FreezeConfig(blocks=3)) == [
        "model.wte",
        "model.wpe",
        "model.h.0",
        "model.h.1",
        "model.h.2",
    ]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["model.ln_f.weight", "model.ln_f.bias", "model.lm_head.weight"]  # its own head: trained
    with pytest.raises(ValueError, match=r"`blocks`=4 but CharLM has 3 repeated blocks.*freeze at most 3"):
        apply(_charlm(), FreezeConfig(blocks=4))


def test_training_config_keyword():
    config = TrainingConfig(freeze_layers={"blocks": 2})
    assert config.freeze_layers == FreezeConfig(blocks=2)
    assert "freeze_layers(blocks=2, embeddings=True)" in config.describe()
    assert TrainingConfig(**config.to_dict()) == config


@pytest.mark.parametrize("order", ["freeze first", "lora first"])
def test_lora_puts_no_adapter_in_a_frozen_block(order):
    model = _charlm()
    configs = [FreezeConfig(blocks=2), LoRAConfig(r=2)]
    apply(model, configs if order == "freeze first" else configs[::-1])  # the registry's order decides
    assert sorted({name.split(".")[2] for name in lora_layers(model)}) == ["2"]  # only model.h.2 is adapted
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 8 and all(n.startswith("model.h.2.") and ".lora_" in n for n in trainable)


def test_pruned_weights_in_a_frozen_block_are_refused():
    model = _charlm()
    with pytest.raises(ValueError, match=r"FreezeLayers and pruning do not compose: \['model\.h\.0\.ln_1\.weight'"):
        apply(model, TrainingConfig(freeze_layers={"blocks": 1}, pruning=PruningConfig(amount=0.5)))
    assert all(p.requires_grad for p in model.parameters())  # the failed apply undid the pruning and the freeze
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())


def test_the_estimate_is_the_measured_step_and_counts_no_state_for_frozen_parameters():
    batch = (torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16)))
    config = TrainingConfig(freeze_layers={"blocks": 2})
    estimate = estimate_memory(_charlm(), batch, device="cpu", config=config)
    assert estimate.peak_bytes == _real_peak(_charlm(), batch, config)  # byte for byte
    plain = estimate_memory(_charlm(), batch, device="cpu", config=TrainingConfig())
    model = _charlm()
    frozen = [
        p for name in frozen_modules(model, FreezeConfig(blocks=2)) for p in model.get_submodule(name).parameters()
    ]
    frozen_bytes = sum(p.numel() * 4 for p in frozen)
    # AdamW: exp_avg, exp_avg_sq and a 4-byte step per trained tensor -- none for a frozen one
    assert plain.breakdown["optimizer_state"] - estimate.breakdown["optimizer_state"] == 2 * frozen_bytes + 4 * len(
        frozen
    )
    assert estimate.peak_bytes < plain.peak_bytes
    plan = plan_memory(_charlm(), batch, "1GiB", device="cpu", config=config, max_estimates=4)
    assert plan.config.freeze_layers == FreezeConfig(blocks=2)
