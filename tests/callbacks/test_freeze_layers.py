"""`FreezeLayers`: a fit with the embeddings and the first blocks frozen; resume; LoRA in either order; pruning."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_lowmem import FreezeLayers, LowRankAdapters, ScheduledPruning
from lightning_lowmem.demo import CharLM, CharLMDataModule
from lightning_lowmem.functional.lora.adapters import lora_layers

FROZEN = ["model.wte", "model.wpe", "model.h.0"]


def _charlm() -> CharLM:
    torch.manual_seed(0)
    return CharLM(n_layer=2, n_head=2, n_embd=32, block_size=16)


def _data() -> CharLMDataModule:
    return CharLMDataModule(block_size=16, batch_size=4, max_chars=5000)


def _trainer(tmp_path, callbacks, max_steps: int = 3, **kwargs) -> L.Trainer:
    kwargs = {"enable_checkpointing": False, **kwargs}
    return L.Trainer(
        max_steps=max_steps,
        limit_val_batches=0,
        callbacks=callbacks,
        accelerator="cpu",
        default_root_dir=str(tmp_path),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


class _Grads(L.Callback):
    """The parameters that had a gradient after the first backward, and the optimizer's parameters."""

    def on_after_backward(self, trainer, pl_module):
        if not hasattr(self, "with_grad"):
            self.with_grad = {n for n, p in pl_module.named_parameters() if p.grad is not None}
            ids = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
            self.in_optimizer = {n for n, p in pl_module.named_parameters() if id(p) in ids}


def _frozen_names(module) -> set[str]:
    return {f"{m}.{p}" for m in FROZEN for p, _ in module.get_submodule(m).named_parameters()}


def test_a_fit_trains_only_the_unfrozen_parameters(tmp_path):
    model, callback, grads = _charlm(), FreezeLayers(blocks=1), _Grads()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _trainer(tmp_path, [callback, grads]).fit(model, _data())
    assert callback.frozen == FROZEN
    frozen = _frozen_names(model)
    everything = {n for n, _ in model.named_parameters()}
    assert grads.with_grad == grads.in_optimizer == everything - frozen  # no gradient, no optimizer entry
    assert callback.removed_from_optimizers == len(frozen)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in frozen)  # bit-identical after 3 steps
    assert not torch.equal(before["model.h.1.attn.c_attn.weight"], after["model.h.1.attn.c_attn.weight"])
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen  # frozen is the fit's result


def test_resume_freezes_the_same_set(tmp_path):
    callback = FreezeLayers(blocks=1)
    trainer = _trainer(tmp_path, [callback], max_steps=2, enable_checkpointing=True)
    model = _charlm()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(model, _data())
    path = tmp_path / "freeze.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["callbacks"]["FreezeLayers"] == {
        "blocks": 1,
        "embeddings": True,
        "frozen": FROZEN,
    }
    resumed_callback = FreezeLayers(blocks=1)
    resumed = _charlm()
    resumed_trainer = _trainer(tmp_path, [resumed_callback], max_steps=4)
    resumed_trainer.fit(resumed, _data(), ckpt_path=str(path))
    assert resumed_trainer.global_step == 4 and resumed_callback.frozen == FROZEN
    after = resumed.state_dict()
    assert all(torch.equal(initial[k], after[k]) for k in _frozen_names(resumed))  # frozen through both runs


def test_resume_with_another_frozen_set_is_refused_in_one_line(tmp_path):
    trainer = _trainer(tmp_path, [FreezeLayers(blocks=1)], max_steps=1)
    trainer.fit(_charlm(), _data())
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    expected = (
        r"^FreezeLayers\(blocks=2, embeddings=True\) freezes \[.*'model\.h\.1'\], but the checkpoint was trained "
        r"with \['model\.wte', 'model\.wpe', 'model\.h\.0'\] frozen .*resume with FreezeLayers\(blocks=1, embeddings=True\)$"
    )
    with pytest.raises(ValueError, match=expected):
        _trainer(tmp_path, [FreezeLayers(blocks=2)], max_steps=2).fit(
            _charlm(), _data(), ckpt_path=str(tmp_path / "one.ckpt")
        )


@pytest.mark.parametrize("lora_first", [False, True], ids=["freeze-then-lora", "lora-then-freeze"])
def test_lora_puts_no_adapter_in_the_frozen_blocks_in_either_order(tmp_path, lora_first):
    torch.manual_seed(0)
    model = CharLM(n_layer=3, n_head=2, n_embd=32, block_size=16)
    callbacks = [FreezeLayers(blocks=2), LowRankAdapters(r=2)]
    _trainer(tmp_path, callbacks[::-1] if lora_first else callbacks, max_steps=1).fit(model, _data())
    assert sorted(lora_layers(model)) == [
        "model.h.2.attn.c_attn",
        "model.h.2.attn.c_proj",
        "model.h.2.mlp.c_fc",
        "model.h.2.mlp.c_proj",
    ]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # r=2 adapters of model.h.2 only: c_attn 32->96, c_proj 32->32, c_fc 32->128, mlp.c_proj 128->32
    assert trainable == 2 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32)) == 1024
    assert callbacks[1].report.trainable_params == trainable


def test_pruning_beside_it_is_refused_before_any_change(tmp_path):
    model = _charlm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pruning = ScheduledPruning("l1_unstructured", schedule="linear", target_sparsity=0.5, end_step=2)
    with pytest.raises(ValueError, match=r"^FreezeLayers\(blocks=1\) and ScheduledPruning\('l1_unstructured'\) do"):
        _trainer(tmp_path, [FreezeLayers(blocks=1), pruning]).fit(model, _data())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters())


def test_argument_errors():
    with pytest.raises(ValueError, match=r"`blocks`=-2 must be an int >= 0"):
        FreezeLayers(blocks=-2)
    with pytest.raises(ValueError, match=r"`blocks`=5 but CharLM has 2 repeated blocks"):
        FreezeLayers(blocks=5).setup(_trainer(None, []), _charlm(), "fit")


def test_lowmem_estimate_reads_the_example_config(capsys):
    import json
    from pathlib import Path

    from lightning_lowmem.cli import main

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "freeze_layers.yaml"
    assert main(["estimate", "--device", "cpu", "--json", "--config", str(config), "--batch-shape", "4x64,4x64"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["meta"]["config"]["freeze_layers"] == {"blocks": 2, "embeddings": True}
