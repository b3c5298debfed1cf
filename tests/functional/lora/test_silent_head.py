"""A zero-initialised output head that no adapter reaches (timm's ``head``, torchvision's ``heads.head``, ``fc``):
frozen, it passes back no gradient and LoRA trained nothing (outputs bit-identical after steps, no warning).
``train_modules="auto"`` now trains it in full; an explicit choice that leaves it frozen is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.lora import apply_lora_


class TinyViT(nn.Module):
    """Patch embedding, one MLP block, a zero-initialised head (as timm / torchvision initialise a fresh one)."""

    def __init__(self, head: str = "head", classes: int = 5) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(12, 16)
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        layer = nn.Linear(16, classes)
        nn.init.zeros_(layer.weight)
        nn.init.zeros_(layer.bias)
        if head == "heads.head":
            self.heads = nn.Sequential()
            self.heads.add_module("head", layer)
        else:
            setattr(self, head, layer)
        self.head_name = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, P, 12) -> (B, classes)
        features = self.block(self.patch_embed(x)).mean(dim=1)
        return self.get_submodule(self.head_name)(features)


def _train(model: nn.Module, steps: int = 6) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(8, 4, 12), torch.randint(0, 5, (8,))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("head", ["head", "heads.head", "fc"])
def test_a_zero_head_trains_in_full_and_the_outputs_move(head):
    torch.manual_seed(0)
    model = TinyViT(head)
    probe = torch.randn(3, 4, 12)
    before = model(probe).detach().clone()
    report = apply_lora_(model, r=4, target=["patch_embed", "block.0", "block.2"])
    assert report.trained == [head]
    assert all(p.requires_grad for p in model.get_submodule(head).parameters())
    _train(model)
    after = model(probe).detach()
    assert not torch.equal(before, after) and (after - before).abs().max() > 1e-3
    lora_b = [p for name, p in model.named_parameters() if name.endswith("lora_B")]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # every adapter got a gradient


def test_the_broad_target_leaves_head_out_and_auto_still_trains_it():
    torch.manual_seed(0)
    model = TinyViT("head")
    report = apply_lora_(model, r=4)  # "all-linear": `head` is an output head, no adapter
    assert "head" not in report.wrapped and report.trained == ["head"]


def test_an_explicit_choice_that_leaves_the_zero_head_frozen_stops_in_one_line():
    with pytest.raises(ValueError, match=r"output layer 'head' is all zeros and would stay frozen.*train_modules"):
        apply_lora_(TinyViT("head"), r=4, train_modules=None)
    with pytest.raises(ValueError, match=r"output layer 'fc' is all zeros"):
        apply_lora_(TinyViT("fc"), r=4, target=["block.0"], train_modules=["block.2"])


def test_an_adapted_or_non_zero_head_changes_nothing():
    torch.manual_seed(0)
    adapted = apply_lora_(TinyViT("fc"), r=4, target=["block.0", "fc"], train_modules=None)
    assert adapted.trained == [] and "fc" in adapted.wrapped  # the adapter on it gets a gradient
    model = TinyViT("head")
    nn.init.normal_(model.head.weight)
    assert apply_lora_(model, r=4).trained == []  # a random frozen head passes gradients back
    unfrozen = apply_lora_(TinyViT("head"), r=4, freeze_base=False, train_modules=None)
    assert unfrozen.trained == []  # nothing frozen: the head trains anyway
