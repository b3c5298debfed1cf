"""LoRA on nn.Conv2d (PEFT's conv adapter: A a conv with the layer's kernel into r channels, B a 1 x 1 conv back):
exact at step 0, trains, merges to the same numbers, travels in adapter files, counts exactly, estimates exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.lora import (
    apply_lora_,
    load_adapters,
    lora_state_dict,
    merge_lora_,
    merged_state_dict,
    save_adapters,
    unmerge_lora_,
)
from lightning_lowmem.functional.lora.layers import LoraConv2d, lora_layers
from lightning_lowmem.warnings import NoEffectWarning
from tests.vision_zoo import hf_resnet, image_batch, staged_cnn

CONVS = 10  # HF ResNet (16, 32) x (2, 2): the stem, 8 in the blocks, 1 shortcut


def _logits(model, images):
    out = model(images)
    return getattr(out, "logits", out)


def _step(model, batch, lr=1e-2):
    images, labels = batch
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    optimizer.zero_grad()
    nn.functional.cross_entropy(_logits(model, images), labels).backward()
    optimizer.step()


def _randomise(model):
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.05)


def test_hf_resnet_all_conv_is_exact_at_step_zero_and_counts_exactly():
    model, (images, _) = hf_resnet().eval(), image_batch()
    reference = _logits(model, images)
    report = apply_lora_(model, r=4, target="all-conv")
    assert len(report.wrapped) == CONVS and all(isinstance(layer, LoraConv2d) for layer in lora_layers(model).values())
    assert report.trained == ["classifier"]  # the fresh head trains in full beside the adapters
    assert torch.equal(_logits(model, images), reference)
    # r * in * kh * kw (A) + out * r (B) per conv: stem 3->16 k7; 4 x 16->16 k3; 16->32 k3, 3 x 32->32 k3, 16->32 k1
    adapters = (4 * 3 * 49 + 16 * 4) + 4 * (4 * 16 * 9 + 16 * 4) + (4 * 16 * 9 + 32 * 4) + 3 * (4 * 32 * 9 + 32 * 4)
    adapters += 4 * 16 + 32 * 4
    assert report.trainable_params == adapters + 32 * 10 + 10 == 8278  # + the classifier Linear(32, 10)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == report.trainable_params


def test_all_linear_on_a_cnn_names_the_fix_and_all_takes_convs_and_linears():
    with pytest.raises(
        ValueError,
        match=r"found no .* in ResNetForImageClassification; its 10 nn.Conv2d layers get adapters with target='all-conv'",
    ):
        apply_lora_(hf_resnet())
    report = apply_lora_(staged_cnn(), r=2, target="all", train_modules=None)
    assert report.wrapped == ["stem.0"] + [
        f"{s}.{b}.conv{c}" for s in ("layer1", "layer2") for b in (0, 1) for c in (1, 2)
    ] + ["fc"]
    report = apply_lora_(staged_cnn(), r=2, target=["layer1.*.conv1", "fc"], train_modules=None)
    assert report.wrapped == ["layer1.0.conv1", "layer1.1.conv1", "fc"]


def test_lora_b_of_every_conv_gets_a_gradient_and_moves():
    model, batch = hf_resnet(), image_batch()
    apply_lora_(model, r=4, target="all-conv")
    images, labels = batch
    nn.functional.cross_entropy(_logits(model, images), labels).backward()
    layers = lora_layers(model)
    assert all(layer.lora_B.grad.abs().sum() > 0 for layer in layers.values())
    assert all(layer.lora_A.grad.abs().sum() == 0 for layer in layers.values())  # B = 0: no signal to A at step 0
    assert all(layer.weight.grad is None for layer in layers.values())  # the base stays frozen
    model.zero_grad()
    _step(model, batch)
    assert all(layer.lora_B.abs().sum() > 0 for layer in layers.values())


def test_merge_equals_unmerged_and_merged_weights_load_into_the_plain_model():
    model, (images, _) = hf_resnet().eval(), image_batch()
    apply_lora_(model, r=4, target="all-conv", train_modules=None)
    _randomise(model)
    stem = model.resnet.embedder.embedder.convolution
    weight_before = stem.weight.detach().clone()
    adapted = _logits(model, images)
    assert not torch.allclose(adapted, _logits(hf_resnet().eval(), images), atol=1e-3)  # the adapters do something
    fresh = hf_resnet().eval()
    fresh.load_state_dict(merged_state_dict(model), strict=True)  # no adapter keys, the plain architecture
    torch.testing.assert_close(_logits(fresh, images), adapted, atol=1e-5, rtol=0)
    assert merge_lora_(model) == CONVS
    torch.testing.assert_close(_logits(model, images), adapted, atol=1e-5, rtol=0)
    torch.testing.assert_close(stem.weight, weight_before + stem.delta_weight(), atol=0, rtol=0)
    assert unmerge_lora_(model) == CONVS
    torch.testing.assert_close(stem.weight, weight_before, atol=1e-6, rtol=0)
    torch.testing.assert_close(_logits(model, images), adapted, atol=1e-5, rtol=0)


def test_strided_dilated_conv_merges_exactly():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, bias=True)
    model = nn.Sequential(conv)
    apply_lora_(model, r=3, target="0")
    _randomise(model)
    conv = model[0]
    x = torch.randn(2, 4, 9, 9)
    expected = nn.functional.conv2d(x, conv.weight + conv.delta_weight(), conv.bias, stride=2, padding=2, dilation=2)
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=0)


def test_adapter_file_round_trip_into_a_fresh_resnet(tmp_path):
    model, batch = hf_resnet(), image_batch()
    apply_lora_(model, r=4, alpha=8, target="all-conv")
    _step(model, batch)
    _randomise(model)
    state = lora_state_dict(model)
    # lora_A / lora_B per conv, the trained classifier's weight and bias, 3 running statistics per BatchNorm
    assert len(state) == 2 * CONVS + 2 + 3 * CONVS
    save_adapters(model, tmp_path / "adapters.pt")
    fresh = hf_resnet()  # same seed: same base weights
    report = load_adapters(fresh, tmp_path / "adapters.pt")
    assert (report.r, report.alpha, len(report.wrapped), report.trained) == (4, 8.0, CONVS, ["classifier"])
    model.eval(), fresh.eval()
    images, _ = batch
    torch.testing.assert_close(_logits(fresh, images), _logits(model, images), atol=0, rtol=0)


def test_depthwise_and_grouped_convs_are_left_out_by_name_or_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 8, 1))
    with pytest.warns(NoEffectWarning, match=r"left out '1' \(groups=8 \(grouped / depthwise\)\): LoRA adapts"):
        report = apply_lora_(model, r=2, target="all-conv")
    assert report.wrapped == ["0", "2"]
    with pytest.raises(ValueError, match=r"left out '0' \(groups=8 .*Nothing else matched"):
        apply_lora_(nn.Sequential(nn.Conv2d(8, 8, 3, groups=8)), target="0")
    with pytest.raises(
        ValueError, match=r"`quantize_base`='int8' stores the frozen base of linear layers only; \['0'\]"
    ):
        apply_lora_(nn.Sequential(nn.Conv2d(3, 8, 3)), target="0", quantize_base="int8")
    assert not lora_layers(nn.Sequential(nn.Conv2d(3, 8, 3)))


def test_estimate_memory_of_the_lora_conv_net_equals_the_measured_step():
    import warnings

    from lightning_lowmem.functional.applied import apply
    from lightning_lowmem.memory import measure_memory
    from lightning_lowmem.planning.estimate import TrainingConfig, _train_step, default_loss, estimate_memory

    batch = image_batch(8)
    config = TrainingConfig(lora={"r": 4, "target": "all-conv"}, optimizer="adamw")
    estimate = estimate_memory(hf_resnet(), batch, device="cpu", config=config)
    model = hf_resnet()
    applied = apply(model, config)
    optimizer = applied.build_optimizer()
    loop = estimate.meta["loop"]  # "torch": a plain nn.Module
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train_step(model, batch, default_loss, optimizer, config, None, loop=loop)
        measured = measure_memory(
            _train_step, model, batch, default_loss, optimizer, config, None, loop=loop, module=model
        )
    assert estimate.peak_bytes == measured.peak_bytes
    # AdamW keeps two fp32 moments of the 8,278 trainable parameters only (and a 4-byte step for each of 22 tensors)
    assert estimate.breakdown["optimizer_state"] == 2 * 4 * 8278 + 4 * 22


def test_plan_memory_lora_axis_on_cnns():
    from lightning_lowmem.planning.plan import plan_memory

    model, batch = hf_resnet(), image_batch()
    loras = [{"r": 4, "target": "all-conv"}]
    plan = plan_memory(model, batch, 10 * 2**20, device="cpu", margin=0.0, micro_batch_sizes=[None], loras=loras)
    assert plan.config.lora is not None and plan.config.lora.target == "all-conv"
    # "all-linear" cannot be built on a CNN whose only Linear is its head: skipped with the fix, never fatal
    plan = plan_memory(
        hf_resnet(), batch, 10 * 2**20, device="cpu", margin=0.0, micro_batch_sizes=[None], loras=[None, {"r": 4}]
    )
    assert any("target='all-conv'" in reason for reason in plan.skipped)


def test_lowrankadapters_trains_conv_adapters_and_its_adapter_only_checkpoint_reloads(tiny_trainer_kwargs, tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_lowmem.callbacks.low_rank_adapters import LowRankAdapters

    class ImageClassifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = staged_cnn()

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return nn.functional.cross_entropy(self.model(images), labels)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    images, labels = image_batch(16)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=8)
    module, callback = ImageClassifier(), LowRankAdapters(r=2, target="all-conv", train_modules=["fc"])
    kwargs = {**tiny_trainer_kwargs, "enable_checkpointing": True}
    L.Trainer(max_steps=2, callbacks=[callback, ModelCheckpoint(dirpath=tmp_path)], **kwargs).fit(module, data)
    assert len(callback.report.wrapped) == 9 and callback.report.trained == ["model.fc"]
    assert all(layer.lora_B.abs().sum() > 0 for layer in lora_layers(module).values())
    saved = torch.load(next(tmp_path.glob("*.ckpt")), weights_only=False)
    kept = set(saved["state_dict"])
    assert not any(key.endswith(("conv1.weight", "conv2.weight")) for key in kept)  # adapters only, no frozen kernels
    # BatchNorm's running statistics moved in training (the parameters are frozen, the buffers are not): kept
    assert {"model.layer1.0.bn1.running_mean", "model.stem.1.running_var"} <= kept
    fresh = staged_cnn()
    load_adapters(fresh, saved)
    module.model.eval(), fresh.eval()
    torch.testing.assert_close(fresh(images), module.model(images), atol=0, rtol=0)
