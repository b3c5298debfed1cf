"""A freshly initialised classification head trains under LoRA (``train_modules``, PEFT's modules_to_save): it is
unfrozen, it learns, and it travels with the adapters (adapter files, adapter-only checkpoints)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.config import LoRAConfig
from lightning_lowmem.functional.lora import apply_lora_, load_adapters, lora_state_dict, save_adapters
from tests.vision_zoo import hf_vit, image_batch, mha_classifier, token_batch


def _train(model, batch, steps=3):
    inputs, labels = batch
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        out = model(inputs)
        nn.functional.cross_entropy(getattr(out, "logits", out), labels).backward()
        optimizer.step()


def test_auto_trains_the_hf_classifier_head_in_full():
    model = hf_vit()
    before = model.classifier.weight.detach().clone()
    report = apply_lora_(model, r=4)
    assert report.trained == ["classifier"]
    assert "classifier" not in report.wrapped and all(p.requires_grad for p in model.classifier.parameters())
    head = sum(p.numel() for p in model.classifier.parameters())
    adapters = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B")))
    assert report.trainable_params == head + adapters
    _train(model, image_batch())
    assert not torch.equal(model.classifier.weight, before)  # it learnt (frozen at random before)


def test_train_modules_by_name_none_and_errors():
    model = mha_classifier()
    assert apply_lora_(model, target=["linear1"], train_modules=["head"]).trained == ["head"]
    assert model.head.weight.requires_grad and not model.embed.weight.requires_grad
    assert apply_lora_(hf_vit(), r=4, train_modules=None).trained == []
    with pytest.raises(ValueError, match=r"`train_modules` pattern 'nohead' matches no module with parameters"):
        apply_lora_(mha_classifier(), target=["linear1"], train_modules=["nohead"])
    with pytest.raises(
        ValueError, match=r"`train_modules` pattern 'linear1' matches .* a module is adapted or trained"
    ):
        apply_lora_(mha_classifier(), target=["linear1"], train_modules=["linear1"])
    with pytest.raises(ValueError, match=r"`train_modules` must be 'auto', None, a module name pattern"):
        LoRAConfig(train_modules=3)
    assert LoRAConfig(train_modules=["head"]).kwargs()["train_modules"] == ["head"]


def test_the_trained_head_travels_with_the_adapter_file(tmp_path):
    model = mha_classifier()
    apply_lora_(model, target=["linear1", "linear2"], train_modules="head")
    _train(model, token_batch())
    assert {"head.weight", "head.bias"} <= set(lora_state_dict(model))
    save_adapters(model, tmp_path / "adapters.pt")
    fresh = mha_classifier(seed=0)
    report = load_adapters(fresh, tmp_path / "adapters.pt")
    assert report.trained == ["head"] and fresh.head.weight.requires_grad
    tokens, _ = token_batch()
    model.eval(), fresh.eval()
    torch.testing.assert_close(fresh(tokens), model(tokens))


def test_lowrankadapters_trains_the_head_and_keeps_it_in_adapter_only_checkpoints(tiny_trainer_kwargs, tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_lowmem.callbacks.low_rank_adapters import LowRankAdapters

    class ImageClassifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = hf_vit()

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return nn.functional.cross_entropy(self.model(images).logits, labels)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    images, labels = image_batch(16)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=8)
    module = ImageClassifier()
    before = module.model.classifier.weight.detach().clone()
    callback = LowRankAdapters(r=4)
    kwargs = {**tiny_trainer_kwargs, "enable_checkpointing": True}
    trainer = L.Trainer(max_steps=2, callbacks=[callback, ModelCheckpoint(dirpath=tmp_path)], **kwargs)
    trainer.fit(module, data)
    assert callback.report.trained == ["model.classifier"]
    in_optimizer = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert id(module.model.classifier.weight) in in_optimizer
    assert not torch.equal(module.model.classifier.weight, before)
    saved = torch.load(next(tmp_path.glob("*.ckpt")), weights_only=False)
    assert {"model.classifier.weight", "model.classifier.bias"} <= set(saved["state_dict"])
    assert not any(key.startswith("model.vit.embeddings") for key in saved["state_dict"])  # still adapter-only
    fresh = hf_vit()
    load_adapters(fresh, saved)
    torch.testing.assert_close(fresh.classifier.weight, module.model.classifier.weight)


def test_a_head_inside_a_container_is_a_head_and_all_linear_on_a_cnn_names_all_conv():
    from tests.vision_zoo import hf_resnet

    # HF ResNet's head is classifier = Sequential(Flatten, Linear): its Linear is no body layer to adapt
    with pytest.raises(
        ValueError, match=r"found no linear layer in \w+; its \d+ nn.Conv2d layers get adapters with target='all-conv'"
    ):
        apply_lora_(hf_resnet())
