"""Checkpointing "auto" finds the repeated blocks wherever they live: nn.Sequential stages (stages of stages),
nn.ModuleList, the encoder AND decoder of nn.Transformer; gradients and BatchNorm statistics as without it."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.checkpointing import checkpoint_, resolve_policy
from lightning_lowmem.memory import measure_memory
from tests.vision_zoo import (
    hf_convnext,
    hf_resnet,
    hf_vit,
    image_batch,
    mha_classifier,
    sequential_cnn,
    staged_cnn,
    token_batch,
    transformer_seq2seq,
)


def _step(model, batch):
    inputs, labels = batch

    def step():
        out = model(inputs)
        logits = getattr(out, "logits", out)
        nn.functional.cross_entropy(logits, labels).backward()

    return step


def _grads_and_activations(model, batch, policy="auto"):
    """(gradients, BatchNorm buffers, activation bytes) of one step without and with checkpointing."""
    results = []
    for wrap in (False, True):
        copy_ = copy.deepcopy(model).train()
        if wrap:
            assert checkpoint_(copy_, policy).wrapped
        report = measure_memory(_step(copy_, batch), module=copy_)
        grads = {name: p.grad for name, p in copy_.named_parameters()}
        buffers = {name: b.clone() for name, b in copy_.named_buffers()}
        results.append((grads, buffers, report.breakdown["activations"]))
    return results


def test_auto_finds_blocks_in_sequential_stages_of_a_torchvision_style_resnet():
    assert resolve_policy(staged_cnn(), "auto") == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]


def test_auto_wraps_the_encoder_and_the_decoder_of_nn_transformer(caplog):
    model = transformer_seq2seq()
    with caplog.at_level(logging.INFO, logger="lightning_lowmem.functional.checkpointing"):
        wrapped = checkpoint_(model, "auto").wrapped
    assert wrapped == [f"transformer.{part}.layers.{i}" for part in ("encoder", "decoder") for i in (0, 1)]
    assert (
        "wrapped 2 x TransformerEncoderLayer (transformer.encoder.layers.0, transformer.encoder.layers.1), "
        "2 x TransformerDecoderLayer" in caplog.text
    )


def test_auto_takes_a_sequential_of_sequential_blocks_and_refuses_a_flat_one():
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())  # noqa: E731
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), block(), block(), nn.Flatten(), nn.LazyLinear(10))
    assert resolve_policy(model, "auto") == ["1", "2"]
    assert resolve_policy(sequential_cnn(), "auto") == []  # no block repeats: nothing to checkpoint


def test_hf_resnet_gradients_and_batchnorm_statistics_equal_activations_drop():
    model = hf_resnet()
    assert len(resolve_policy(model, "auto")) == 8  # the conv units inside the blocks inside the two stages
    (plain_grads, plain_buffers, plain_acts), (grads, buffers, acts) = _grads_and_activations(model, image_batch())
    for name, grad in plain_grads.items():
        assert torch.equal(grad, grads[name]), name
    for name, buffer in plain_buffers.items():  # the recompute in backward does not update them a second time
        assert torch.equal(buffer, buffers[name]), name
    assert acts < 0.75 * plain_acts, (plain_acts, acts)


def test_nn_transformer_and_encoder_gradients_equal_activations_drop():
    for model in (transformer_seq2seq(), mha_classifier()):
        (plain_grads, _, plain_acts), (grads, _, acts) = _grads_and_activations(model, token_batch())
        for name, grad in plain_grads.items():
            assert torch.equal(grad, grads[name]), name
        assert acts < 0.7 * plain_acts, (type(model).__name__, plain_acts, acts)


def test_auto_on_hf_vit_matches_hugging_faces_own_gradient_checkpointing():
    model, batch = hf_vit(), image_batch()
    theirs = copy.deepcopy(model).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers 5: FutureWarning, renamed activation_checkpointing_enable
        theirs.gradient_checkpointing_enable()
    switched = [name for name, m in theirs.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    (plain_grads, _, plain_bytes), (our_grads, _, our_bytes) = _grads_and_activations(model, batch)
    report = measure_memory(_step(theirs, batch), module=theirs)
    assert resolve_policy(model, "auto") == switched == ["vit.layers.0", "vit.layers.1"]
    assert our_bytes == report.breakdown["activations"] < plain_bytes / 5
    for name, parameter in theirs.named_parameters():
        assert torch.equal(our_grads[name], parameter.grad) and torch.equal(plain_grads[name], parameter.grad), name


@pytest.mark.parametrize("make", [hf_resnet, hf_convnext], ids=["resnet", "convnext"])
def test_auto_checkpoints_hf_vision_models_whose_own_recipe_refuses(make):
    model = make()
    with warnings.catch_warnings(), pytest.raises(ValueError, match="does not support activation checkpointing"):
        warnings.simplefilter("ignore")  # transformers 5: FutureWarning, renamed activation_checkpointing_enable
        copy.deepcopy(model).gradient_checkpointing_enable()
    (plain_grads, _, plain_bytes), (our_grads, _, our_bytes) = _grads_and_activations(model, image_batch())
    assert our_bytes < plain_bytes
    assert all(torch.equal(plain_grads[name], our_grads[name]) for name in plain_grads)
