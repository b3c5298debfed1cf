"""Every feature on Hugging Face's pure-torch ConvNeXt and MobileNetV2 (#25), each case asserting its effect.

ConvNeXt: depthwise 7 x 7 convolutions, LayerNorm and ``nn.Linear`` point-wise layers in ``ConvNextLayer`` blocks.
MobileNetV2: 1 x 1 / depthwise 3 x 3 convolutions, each followed by BatchNorm, in 16 inverted-residual blocks.
Models from ``tests/vision_zoo.py``; the figures quoted in ``docs/vision.md`` come from these cases.
"""

from __future__ import annotations

import copy
import warnings

import lightning as L
import pytest
import torch
from torch import nn

from lightning_lowmem import LowMemoryStrategy, MemoryEfficientOptimizer, MemoryMonitor, ScheduledPruning
from lightning_lowmem.functional.applied import apply
from lightning_lowmem.functional.checkpointing import checkpoint_
from lightning_lowmem.functional.lora.adapters import apply_lora_
from lightning_lowmem.functional.optimizers.savings import WARN_ABOVE, predicted_state_bytes
from lightning_lowmem.functional.pruning.unstructured import prune_
from lightning_lowmem.functional.quantization import quantize_
from lightning_lowmem.memory import measure_memory
from lightning_lowmem.memory.measure import state_bytes
from lightning_lowmem.planning.estimate import TrainingConfig, _train_step, default_loss, estimate_memory
from lightning_lowmem.warnings import LowMemWarning, NoEffectWarning
from tests.vision_zoo import calibrate_batchnorm, hf_convnext, hf_mobilenet_v2, image_batch

pytest.importorskip("transformers")

FAMILIES = {"convnext": hf_convnext, "mobilenet_v2": hf_mobilenet_v2}
BLOCKS = {  # what checkpointing "auto" wraps: (class, qualified names)
    "convnext": ("ConvNextLayer", [f"convnext.encoder.stages.{s}.layers.{i}" for s in (0, 1) for i in (0, 1)]),
    "mobilenet_v2": ("MobileNetV2InvertedResidual", [f"mobilenet_v2.layer.{i}" for i in range(16)]),
}


def logits(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    return model(images).logits


def depthwise_convs(model: nn.Module) -> list[str]:
    return [name for name, layer in model.named_modules() if isinstance(layer, nn.Conv2d) and layer.groups > 1]


class Classifier(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return nn.functional.cross_entropy(logits(self.model, images), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(module: L.LightningModule, callbacks: list, tmp_path, steps: int = 1, **kwargs) -> tuple[L.Trainer, list[str]]:
    """Train ``steps`` steps on 8-image batches; the trainer and the lightning_lowmem warnings raised."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*image_batch(8 * max(1, steps))), batch_size=8)
    trainer = L.Trainer(
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        **kwargs,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    return trainer, [str(w.message) for w in caught if issubclass(w.category, LowMemWarning)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpointing_auto_wraps_the_blocks_gradients_and_batchnorm_statistics_equal(family):
    model, batch = FAMILIES[family]().train(), image_batch()
    block, names = BLOCKS[family]
    results = []
    for wrap in (False, True):
        copy_ = copy.deepcopy(model)
        if wrap:
            wrapped = checkpoint_(copy_, "auto").wrapped
            assert wrapped == names and {type(copy_.get_submodule(n)).__name__ for n in wrapped} == {block}

        def step(copy_=copy_):
            nn.functional.cross_entropy(logits(copy_, batch[0]), batch[1]).backward()

        report = measure_memory(step, module=copy_)
        grads = {name: p.grad for name, p in copy_.named_parameters()}
        buffers = {name: b.clone() for name, b in copy_.named_buffers()}
        results.append((grads, buffers, report.breakdown["activations"]))
    (plain_grads, plain_buffers, plain_acts), (grads, buffers, acts) = results
    assert all(torch.equal(grad, grads[name]) for name, grad in plain_grads.items())
    assert (len(plain_buffers) > 0) == (family == "mobilenet_v2")  # ConvNeXt has no BatchNorm
    for name, buffer in plain_buffers.items():  # the recompute in backward does not move them a second time
        assert torch.equal(buffer, buffers[name]), name
    assert acts < 0.35 * plain_acts, (plain_acts, acts)


@pytest.mark.parametrize("checkpointing", [None, "auto"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_estimate_equals_the_measured_step(family, checkpointing):
    batch = image_batch()
    config = TrainingConfig(optimizer="adamw", activation_checkpointing=checkpointing)
    estimate = estimate_memory(FAMILIES[family](), batch, device="cpu", config=config)
    model = FAMILIES[family]()
    optimizer = apply(model, config).build_optimizer()
    loop = estimate.meta["loop"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train_step(model, batch, default_loss, optimizer, config, None, loop=loop)  # the second step's peak
        measured = measure_memory(
            _train_step, model, batch, default_loss, optimizer, config, None, loop=loop, module=model
        )
    assert (
        estimate.peak_bytes == measured.peak_bytes
    )  # byte for byte (ConvNeXt 11.78 / 6.38 MiB, MobileNet 2.91 / 2.15)


@pytest.mark.parametrize(
    ("family", "make", "max_error"),
    [
        ("convnext", hf_convnext, 0.02),
        # MobileNetV2's own width (2.2M parameters): at depth_multiplier 0.25 a 1 x 1 conv has 4-8 weights per
        # output channel, and its float BatchNorm and per-channel scale weigh as much: 2.79x there (measured)
        ("mobilenet_v2", lambda: hf_mobilenet_v2(depth_multiplier=1.0), 0.05),
    ],
)
def test_int8_weight_only_ships_3_5x_smaller_depthwise_convs_included(family, make, max_error):
    images, _ = image_batch()
    model = calibrate_batchnorm(make(), images)
    with torch.no_grad():
        reference = logits(model, images)
    bytes_before = state_bytes(model)["parameters"]
    report = quantize_(model, "int8_weight_only")
    ratio = bytes_before / state_bytes(model)["parameters"]
    assert ratio >= 3.5 and report.size_ratio == pytest.approx(ratio)
    depthwise = depthwise_convs(model)
    assert depthwise and set(depthwise) <= set(report.converted)
    for name in depthwise:  # int8, one scale per output channel (= per input channel here)
        weight = model.get_submodule(name).weight
        assert weight.qdata.dtype == torch.int8 and tuple(weight.scale.shape[1:]) == (1, 1, 1), name
    with torch.no_grad():
        error = float((logits(model, images) - reference).norm() / reference.norm())
    assert error < max_error, error


@pytest.mark.parametrize(("family", "adapted", "depthwise"), [("convnext", 2, 4), ("mobilenet_v2", 35, 17)])
def test_lora_all_conv_leaves_depthwise_out_and_trains_the_classifier(family, adapted, depthwise, tmp_path):
    model = FAMILIES[family]()
    left_out = depthwise_convs(model)
    assert len(left_out) == depthwise
    with pytest.warns(NoEffectWarning) as caught:
        report = apply_lora_(model, r=4, target="all-conv")
    (message,) = [str(w.message) for w in caught]  # one warning, naming the first four and the count
    assert all(f"'{name}' (groups=" in message for name in left_out[:4]) and (f"({depthwise} in all)" in message) == (
        depthwise > 4
    )
    convs = [n for n, layer in model.named_modules() if isinstance(layer, nn.Conv2d) and not n.endswith("lora_A")]
    convs = [n for n in convs if not n.endswith("lora_B")]
    assert len(report.wrapped) == adapted == len(convs) - depthwise and not set(report.wrapped) & set(left_out)
    assert report.trained == ["classifier"]
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert {"classifier.weight", "classifier.bias"} <= trainable
    assert all("lora_" in name or name.startswith("classifier.") for name in trainable)
    lora_b = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_B" in name}
    assert len(lora_b) == adapted and all(not b.any() for b in lora_b.values())
    module = Classifier(model)
    fit(module, [], tmp_path)  # one AdamW step
    moved = [name for name, p in model.named_parameters() if "lora_B" in name and p.detach().any()]
    assert len(moved) == adapted  # every adapter got a gradient: the classifier is not frozen at random


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pruning_is_exactly_at_target_over_the_targeted_weights(family, tmp_path):
    model = FAMILIES[family]()
    report = prune_(model, 0.5, global_=True, heads=True)  # every layer, the classifier too (heads=True)
    targeted = [model.get_parameter(name) for name in report.per_tensor]
    convs = [n for n, layer in model.named_modules() if isinstance(layer, (nn.Conv2d, nn.Linear))]
    assert {f"{n}.weight" for n in convs} <= set(report.per_tensor)  # depthwise convs and the classifier too
    zeros, total = sum(int((p == 0).sum()) for p in targeted), sum(p.numel() for p in targeted)
    assert zeros == round(0.5 * total) and report.sparsity == zeros / total
    # the callback, through a fit: exact too
    module = Classifier(FAMILIES[family]())
    pruning = ScheduledPruning(schedule="constant", target_sparsity=0.5, parameter_names=["weight"], prune_heads=True)
    fit(module, [pruning], tmp_path)
    targeted = [module.model.get_parameter(name) for name in report.per_tensor]
    zeros = sum(int((p == 0).sum()) for p in targeted)
    assert zeros == round(0.5 * total), (zeros, total)


@pytest.mark.parametrize("name", ["adamw8bit", "adafactor"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_lean_optimizer_warns_exactly_when_it_keeps_over_half_of_adamw(family, name, tmp_path):
    pytest.importorskip("torchao")
    model = FAMILIES[family]()
    lean, adamw = predicted_state_bytes(name, model.parameters())
    # the warning comes at setup; no step (torchao's 8-bit step compiles for a minute on CPU)
    trainer, messages = fit(Classifier(model), [MemoryEfficientOptimizer(name, lr=1e-3)], tmp_path, steps=0)
    assert type(trainer.optimizers[0]).__name__ == {"adamw8bit": "AdamW8bit", "adafactor": "Adafactor"}[name]
    warned = [m for m in messages if "optimizer state" in m]
    assert bool(warned) == (lean > WARN_ABOVE * adamw), (lean / adamw, warned)
    if warned:
        assert len(warned) == 1 and f"{lean / adamw:.2f}x fp32 AdamW" in warned[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_plan_at_a_budget_only_a_lean_mix_fits_trains_under_it(family, tmp_path):
    batch = image_batch(8)

    def peak(**config) -> int:
        config = TrainingConfig(optimizer="adamw", **config)
        return estimate_memory(Classifier(FAMILIES[family]()), batch, device="cpu", config=config).peak_bytes

    lean, plain = peak(precision="bf16-true", activation_checkpointing="auto"), peak(precision="bf16-true")
    assert lean < plain
    budget = (lean + plain) // 2  # bf16-true alone does not fit: checkpointing (or leaner) must be in the mix
    strategy = LowMemoryStrategy(memory_budget=int(budget / 0.9))  # the strategy's 10% margin: the same budget
    monitor = MemoryMonitor(summary=False)
    fit(Classifier(FAMILIES[family]()), [monitor], tmp_path, steps=2, strategy=strategy)
    plan = strategy.plan  # plan_memory's answer, not "no configuration fits"
    assert plan.predicted_peak_bytes <= budget and plan.config.precision_preset == "bf16-true"
    assert plan.config.describe() != "bf16-true + adamw"  # over the budget: a leaner mix was needed
    assert monitor.last_report.peak_bytes == plan.predicted_peak_bytes <= budget
