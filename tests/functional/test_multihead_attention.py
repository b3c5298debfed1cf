"""nn.MultiheadAttention reads out_proj.weight and in_proj_weight as tensors (F.multi_head_attention_forward):
no transform may leave a wrapper there that is never called. LoRA adapts both for real (LoraMultiheadAttention);
QAT / PTQ leave out_proj alone and say so; pruning masks in_proj_weight for real."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.lora import apply_lora_
from lightning_lowmem.functional.pruning import prune_, sparsity
from lightning_lowmem.functional.pruning.masks import apply_masks_
from lightning_lowmem.warnings import NoEffectWarning
from tests.vision_zoo import mha_classifier, token_batch, transformer_seq2seq

OUT_PROJ = (
    r"left out 'encoder\.layers\.0\.self_attn\.out_proj', 'encoder\.layers\.1\.self_attn\.out_proj': the out_proj"
)


def _train(model, steps=2):
    tokens, labels = token_batch()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(tokens), labels).backward()
        optimizer.step()


def test_lora_adapts_in_proj_weight_and_out_proj_for_real():
    model = mha_classifier()
    report = apply_lora_(model, target="all-linear")  # no warning: nothing is left out any more
    expected = []
    for i in (0, 1):
        layer = f"encoder.layers.{i}"
        expected += [f"{layer}.self_attn", f"{layer}.self_attn.out_proj", f"{layer}.linear1", f"{layer}.linear2"]
    assert report.wrapped == expected
    _train(model)
    adapters = {name: p for name, p in model.named_parameters() if name.endswith("lora_B")}
    assert len(adapters) == 8 and all(p.abs().sum() > 0 for p in adapters.values())  # every adapter trained
    assert "encoder.layers.0.self_attn.lora_B" in adapters  # in_proj_weight's (Q / K / V) adapter


def test_lora_targeting_only_mha_out_proj_trains_it():
    model = mha_classifier()
    report = apply_lora_(model, target="out_proj")
    assert report.wrapped == [f"encoder.layers.{i}.self_attn.out_proj" for i in (0, 1)]
    _train(model)
    assert all(model.encoder.layers[i].self_attn.out_proj.lora_B.abs().sum() > 0 for i in (0, 1))


@pytest.mark.parametrize("build", [mha_classifier, transformer_seq2seq])
def test_int8_ptq_leaves_mha_out_proj_float_and_runs_in_train_eval_and_no_grad(build):
    from lightning_lowmem.functional.quantization import quantize_

    model = build()
    tokens, _ = token_batch()
    with pytest.warns(NoEffectWarning, match=r"quantize_\(mode='int8_dynamic'\) left out .*self_attn\.out_proj"):
        report = quantize_(model, "int8_dynamic")
    assert report.converted and not any(name.endswith("out_proj") for name in report.converted)
    assert all(type(m.out_proj.weight) is nn.Parameter for m in model.modules() if isinstance(m, nn.MultiheadAttention))
    model.train()
    assert model(tokens).shape == (4, 10)  # used to raise NotImplementedError (Int8Tensor, aten.t) from out_proj
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(tokens)).all()


def test_qat_prepares_only_layers_whose_forward_runs():
    from lightning_lowmem.functional.quantization import prepare_qat_

    model = mha_classifier()
    with pytest.warns(NoEffectWarning, match=r"prepare_qat_\(mode='int8_weight_only'\) " + OUT_PROJ[:8]):
        names = prepare_qat_(model, "int8_weight_only")
    called = set()
    for name in names:
        model.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: called.add(name))
    _train(model, steps=1)
    assert names and called == set(names)  # no fake-quantizer that is never called


def test_pruning_masks_in_proj_weight_and_counts_it():
    model = mha_classifier()
    report = prune_(model, 0.5, parameter_names=("weight",))
    in_proj = model.encoder.layers[0].self_attn.in_proj_weight
    assert "encoder.layers.0.self_attn.in_proj_weight" in report.per_tensor
    assert float((in_proj == 0).float().mean()) == pytest.approx(0.5, abs=0.02)
    _train(model, steps=1)
    apply_masks_(model)  # what the callback does after each optimizer step
    assert float((in_proj == 0).float().mean()) == pytest.approx(0.5, abs=0.02)
    pruned = [t for name, t in model.named_parameters() if name in report.per_tensor]
    zeros, total = sum(int((t == 0).sum()) for t in pruned), sum(t.numel() for t in pruned)
    assert in_proj.numel() * 2 / total > 0.25  # a quarter of what is pruned: the figure would move without it
    assert sparsity(model) == report.sparsity == pytest.approx(zeros / total)
