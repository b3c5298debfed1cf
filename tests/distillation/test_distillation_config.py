"""`DistillationConfig` and `distillation_losses` (distillation/config.py): validated once, usable without Lightning (#27)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_lowmem.distillation import DistillationModule
from lightning_lowmem.distillation.config import DistillationConfig, distillation_losses
from lightning_lowmem.distillation.losses import kd_loss

BAD = [
    (dict(temperature=0), ValueError, r"`temperature` must be > 0, got 0"),
    (dict(temperature="2"), TypeError, r"`temperature` must be a number, got str: '2'"),
    (dict(alpha=1.5), ValueError, r"`alpha` must be in \[0, 1\] \(weight of the distillation term\), got 1.5"),
    (dict(hint_weight=-1.0), ValueError, r"`hint_weight` must be >= 0"),
    (dict(loss="kdd"), ValueError, r"`loss`='kdd' is not registered; choose from \["),
    (
        dict(teacher_precision="int4"),
        ValueError,
        r"`teacher_precision`='int4' is unknown; choose from \['32', 'bf16', 'int8'\]",
    ),
    (dict(cache_top_k=0, teacher_cache="c.pt"), ValueError, r"`cache_top_k` must be a positive int or None, got 0"),
    (dict(cache_dtype="bfloat16", teacher_cache="c.pt"), ValueError, r"`cache_dtype`='bfloat16' is not supported"),
    (dict(hint_layers={"a": "b"}, teacher_cache="c.pt"), ValueError, r"`hint_layers` need the live teacher's features"),
    (dict(hint_layers=["a"]), TypeError, r"`hint_layers` must map student layer names to teacher layer names"),
    (dict(ignore_index=None), TypeError, r"`ignore_index` must be an int"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD)
def test_config_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistillationConfig(**kwargs)


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD)
def test_the_module_raises_the_configs_message(kwargs, error, match):
    """DistillationModule keeps its signature and has no checks of its own for these arguments."""
    with pytest.raises(error, match=match):
        DistillationModule(nn.Linear(4, 3), nn.Linear(4, 3), **kwargs)


def test_the_module_builds_its_config():
    module = DistillationModule(nn.Linear(4, 3), nn.Linear(4, 3), temperature=4.0, alpha=0.9, hint_weight=0.5)
    assert module.config == DistillationConfig(temperature=4.0, alpha=0.9, hint_weight=0.5)
    assert module.hparams.temperature == 4.0  # the saved hyperparameters are unchanged
    assert DistillationConfig(hint_layers={"fc1": "fc2"}).hint_layers == (("fc1", "fc2"),)
    assert hash(DistillationConfig(hint_layers={"fc1": "fc2"})) == hash(DistillationConfig(hint_layers={"fc1": "fc2"}))


def test_distillation_losses_on_plain_tensors():
    torch.manual_seed(0)
    student, teacher, targets = torch.randn(8, 5), torch.randn(8, 5), torch.randint(0, 5, (8,))
    config = DistillationConfig(temperature=3.0, alpha=0.7)
    losses = distillation_losses(config, student, teacher, targets)
    expected = kd_loss(student, teacher, targets, temperature=3.0, alpha=0.7)
    assert torch.allclose(losses["loss"], expected) and set(losses) == {"loss", "logit_loss"}
    # same logits: the KD term is 0 and alpha=1 leaves nothing else
    assert float(distillation_losses(DistillationConfig(alpha=1.0), student, student, targets)["loss"]) == 0.0


def test_distillation_losses_adds_the_weighted_hints():
    config = DistillationConfig(alpha=1.0, hint_layers={"s": "t"}, hint_weight=0.5)
    logits = torch.zeros(2, 3)
    features = ({"s": torch.ones(2, 4)}, {"t": torch.zeros(2, 4)})
    losses = distillation_losses(
        config, logits, logits, None, student_features=features[0], teacher_features=features[1]
    )
    assert float(losses["hint_loss"]) == 1.0  # MSE of ones against zeros
    assert math.isclose(float(losses["loss"]), 0.5)  # 0 (same logits) + 0.5 * 1
