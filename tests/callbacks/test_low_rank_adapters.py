"""LowRankAdapters callback: adapters-only training and checkpoints, exact resume, HF GPT-2, bad input."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_lowmem.callbacks.low_rank_adapters import LowRankAdapters
from lightning_lowmem.demo.charlm import BlockDataset, CharLM
from lightning_lowmem.functional.lora.adapters import lora_layers
from lightning_lowmem.functional.lora.files import load_adapters, lora_state_dict

warnings.filterwarnings("ignore", message=".*Enum subclass.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def _charlm(seed: int = 0) -> CharLM:
    torch.manual_seed(seed)
    return CharLM(n_layer=2, n_head=2, n_embd=32, block_size=16, lr=1e-2)


def _loader() -> DataLoader:
    data = torch.randint(0, 256, (16 * 8 * 4 + 1,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    return DataLoader(BlockDataset(data, 16), batch_size=8, shuffle=False)  # fixed order: exact resume


def _fit(model: L.LightningModule, kwargs: dict, callbacks: list, ckpt_path=None, **trainer_args) -> L.Trainer:
    trainer = L.Trainer(**{**kwargs, **trainer_args}, callbacks=callbacks, limit_val_batches=0)
    trainer.fit(model, train_dataloaders=_loader(), ckpt_path=ckpt_path)
    return trainer


def test_only_adapters_train_and_reach_the_optimizer(tiny_trainer_kwargs):
    model = _charlm()
    base_before = {k: v.clone() for k, v in model.state_dict().items()}
    callback = LowRankAdapters(r=4, alpha=8)
    trainer = _fit(model, tiny_trainer_kwargs, [callback], max_steps=4)
    adapter_params = {id(p) for n, p in model.named_parameters() if n.endswith((".lora_A", ".lora_B"))}
    in_optimizer = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert in_optimizer == adapter_params and len(adapter_params) == 16
    assert callback.removed_from_optimizers == len(base_before)  # every base tensor was taken out
    for key, value in base_before.items():
        assert torch.equal(model.state_dict()[key], value), key  # base bitwise unchanged
    assert model.model.h[0].attn.c_attn.lora_B.abs().sum() > 0  # adapters trained


def test_checkpoint_holds_adapters_only_and_resume_equals_uninterrupted(tiny_trainer_kwargs, tmp_path):
    uninterrupted = _charlm()
    _fit(uninterrupted, tiny_trainer_kwargs, [LowRankAdapters(r=4)], max_epochs=2, limit_train_batches=3)

    first = _charlm()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    kwargs = {**tiny_trainer_kwargs, "enable_checkpointing": True}
    _fit(first, kwargs, [LowRankAdapters(r=4), checkpoint], max_epochs=1, limit_train_batches=3)
    path = next((tmp_path / "ckpt").glob("*.ckpt"))

    saved = torch.load(path, map_location="cpu", weights_only=True)
    state = saved["state_dict"]
    adapter_numel = sum(t.numel() for t in lora_state_dict(first).values())
    assert set(state) == set(lora_state_dict(first)) and all(k.startswith("model.h.") for k in state)
    assert sum(t.numel() * t.element_size() for t in state.values()) == 4 * adapter_numel  # fp32 adapters only
    assert len(saved["optimizer_states"][0]["state"]) == 16  # AdamW state for the 16 adapter tensors only
    assert saved["callbacks"]["LowRankAdapters"]["lora_config"]["r"] == 4

    resumed = _charlm()
    trainer = L.Trainer(
        **tiny_trainer_kwargs,
        callbacks=[LowRankAdapters(r=4)],
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=0,
    )
    trainer.fit(resumed, train_dataloaders=_loader(), ckpt_path=path)
    assert trainer.global_step == 6
    for key, value in lora_state_dict(uninterrupted).items():
        assert torch.equal(lora_state_dict(resumed)[key], value), key
    torch.testing.assert_close(resumed.state_dict(), uninterrupted.state_dict(), atol=0, rtol=0)

    fresh = _charlm()  # a fresh base model: load_adapters reads the Lightning checkpoint directly
    report = load_adapters(fresh, path)
    assert report.r == 4 and len(report.wrapped) == 8
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(fresh(tokens), first(tokens), atol=0, rtol=0)


def test_merged_weights_written_at_fit_end_and_metrics_logged(tiny_trainer_kwargs, tmp_path):
    model = _charlm()
    merged_path = tmp_path / "merged.pt"
    kwargs = {**tiny_trainer_kwargs, "logger": CSVLogger(tmp_path, name="logs")}
    _fit(model, kwargs, [LowRankAdapters(r=4, merged_weights_path=str(merged_path))], max_steps=3)
    plain = _charlm(seed=1)
    plain.load_state_dict(torch.load(merged_path, weights_only=True), strict=True)
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(plain(tokens), model(tokens), atol=1e-5, rtol=0)
    rows = list(csv.DictReader(open(next(Path(tmp_path, "logs").rglob("metrics.csv")))))
    logged = next(row for row in rows if row.get("lowmem/lora/trainable_params"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert float(logged["lowmem/lora/trainable_params"]) == trainable


class GPT2Module(L.LightningModule):
    """A Hugging Face GPT-2 (Conv1D layers) inside a LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x).logits  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("quantize_base", [None, "int8"])
def test_hf_gpt2_conv1d_in_lightning_module(tiny_trainer_kwargs, quantize_base):
    pytest.importorskip("transformers")
    module = GPT2Module()
    base_before = {k: v.clone() for k, v in module.state_dict().items()}
    callback = LowRankAdapters(r=4, target=["c_attn", "c_proj", "c_fc"], quantize_base=quantize_base)
    _fit(module, tiny_trainer_kwargs, [callback], max_steps=3)
    assert len(lora_layers(module)) == 8
    assert type(module.model.transformer.h[0].attn.c_attn.weight).__name__ == (
        "Int8Tensor" if quantize_base else "Parameter"
    )
    assert module.model.transformer.h[1].mlp.c_fc.lora_B.abs().sum() > 0
    for key in ("model.transformer.wte.weight", "model.transformer.h.0.ln_1.weight"):
        assert torch.equal(module.state_dict()[key], base_before[key])


def test_bad_arguments_and_mismatched_resume(tiny_trainer_kwargs):
    with pytest.raises(ValueError, match=r"`r` \(adapter rank\) must be an int > 0, got -2"):
        LowRankAdapters(r=-2)
    with pytest.raises(ValueError, match="`quantize_base` must be one of .*got 'fp4'"):
        LowRankAdapters(quantize_base="fp4")
    with pytest.raises(ValueError, match="`target` must be 'all-linear', a layer name pattern or a list.*got int"):
        LowRankAdapters(target=5)
    with pytest.raises(ValueError, match="`target` must be a non-empty list"):
        LowRankAdapters(target=[])
    with pytest.raises(
        ValueError,
        match=r"pattern 'q_proj' matches no .*end in: \['c_attn', 'c_fc', 'c_proj', 'lm_head'\]"
        r".*layer names are: \[model\.h\.0\.attn\.c_attn",
    ):
        _fit(_charlm(), tiny_trainer_kwargs, [LowRankAdapters(target=["q_proj"])], max_steps=1)
    with pytest.raises(ValueError, match="trained with r=8 but this LowRankAdapters has r=4"):
        LowRankAdapters(r=4).load_state_dict({"lora_config": {"r": 8, "alpha": 16.0, "quantize_base": None}})


def test_base_weights_path_loads_pretrained_weights_before_wrapping(tiny_trainer_kwargs, tmp_path):
    pretrained = _charlm(seed=3)
    torch.save({"state_dict": pretrained.state_dict()}, tmp_path / "base.ckpt")
    model = _charlm(seed=0)
    LowRankAdapters(r=4, base_weights_path=str(tmp_path / "base.ckpt")).setup(
        L.Trainer(**tiny_trainer_kwargs), model, "fit"
    )
    assert torch.equal(model.model.h[1].mlp.c_fc.weight, pretrained.model.h[1].mlp.c_fc.weight)
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model(tokens), pretrained(tokens), atol=0, rtol=0)  # B = 0: pretrained output
    with pytest.raises(FileNotFoundError, match="`base_weights_path`='missing.ckpt' is not a file"):
        LowRankAdapters(base_weights_path="missing.ckpt").setup(L.Trainer(**tiny_trainer_kwargs), _charlm(), "fit")
    with pytest.raises(ValueError, match="`base_weights_path` must be a file path or None, got int"):
        LowRankAdapters(base_weights_path=3)


def _adapters_only_checkpoint(tiny_trainer_kwargs, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    kwargs = {**tiny_trainer_kwargs, "enable_checkpointing": True}
    _fit(_charlm(), kwargs, [LowRankAdapters(r=4), checkpoint], max_epochs=1, limit_train_batches=2)
    return next((tmp_path / "ckpt").glob("*.ckpt"))


def test_adapters_only_checkpoint_without_the_callback_names_it_before_loading(tiny_trainer_kwargs, tmp_path):
    from lightning_lowmem.callbacks.memory_efficient_optimizer import MemoryEfficientOptimizer
    from lightning_lowmem.checkpoints import CheckpointMismatchError, records

    path = _adapters_only_checkpoint(tiny_trainer_kwargs, tmp_path)
    assert records(torch.load(path, weights_only=True))["LowRankAdapters"]["format"] == "adapters-only"
    model = _charlm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # another lowmem component is there: the check runs before Lightning loads any weight
    with pytest.raises(
        CheckpointMismatchError,
        match=r"written with LowRankAdapters \(format 'adapters-only', version 1\), "
        r"which the loading side lacks: add callbacks=\[LowRankAdapters\(r=4\)\]",
    ):
        _fit(
            model,
            tiny_trainer_kwargs,
            [MemoryEfficientOptimizer("adamw")],
            max_epochs=2,
            limit_train_batches=2,
            ckpt_path=path,
        )
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    with pytest.raises(
        CheckpointMismatchError, match=r"its adapters have r=4 but this Trainer's LowRankAdapters has r=8"
    ):
        _fit(
            _charlm(), tiny_trainer_kwargs, [LowRankAdapters(r=8)], max_epochs=2, limit_train_batches=2, ckpt_path=path
        )
    # no lowmem component at all: nothing of ours runs before Lightning's strict weight load (documented limit)
    with pytest.raises(
        RuntimeError, match=r"(?s)Missing key\(s\) in state_dict.*Unexpected key\(s\) in state_dict: .*lora_A"
    ):
        _fit(_charlm(), tiny_trainer_kwargs, [], max_epochs=2, limit_train_batches=2, ckpt_path=path)


class LlamaModule(L.LightningModule):
    """A Hugging Face Llama as users wrap it: ``self.model``, so the LightningModule's keys start with ``model.``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.config = LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
        )
        self.model = LlamaForCausalLM(self.config)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x).logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_merged_weights_of_a_wrapped_hf_model_load_into_the_original_architecture(tiny_trainer_kwargs, tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    module = LlamaModule()
    path = tmp_path / "merged.pt"
    _fit(module, tiny_trainer_kwargs, [LowRankAdapters(r=4, merged_weights_path=str(path))], max_steps=3)
    state = torch.load(path, weights_only=True)
    assert not any(key.startswith("model.model.") for key in state) and "lm_head.weight" in state
    plain = LlamaForCausalLM(module.config)
    plain.load_state_dict(state, strict=True)  # was: unexpected keys "model.model.embed_tokens.weight", ...
    tokens = torch.randint(0, 256, (2, 16))
    module.eval()
    torch.testing.assert_close(plain(tokens).logits, module.model(tokens).logits, atol=1e-5, rtol=0)
