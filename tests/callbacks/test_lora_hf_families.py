"""LowRankAdapters on every Hugging Face family of the test zoo (GPT-2 Conv1D, Llama, BERT, T5): the default
targets, trainable-parameter counts, only adapters changing, adapters-only checkpoints round-tripping."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_lowmem.callbacks.low_rank_adapters import LowRankAdapters
from lightning_lowmem.functional.lora.adapters import ADAPTER_SUFFIXES, apply_lora_, lora_layers
from lightning_lowmem.functional.lora.files import load_adapters

hf_zoo = pytest.importorskip("tests.hf_zoo", reason="needs transformers")

# "all-linear" per family: every projection of attention and MLP; never the vocabulary projection (lm_head by
# name, BERT's MLM decoder because its weight is the word embedding's)
EXPECTED_LEAVES = {
    "gpt2": ({"c_attn", "c_proj", "c_fc"}, 8),
    "llama": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, 14),
    "bert": ({"query", "key", "value", "dense"}, 13),  # 6 per layer + the MLM transform's dense
    "t5": ({"q", "k", "v", "o", "wi", "wo"}, 32),  # encoder 6 per layer, decoder 10 (self + cross attention)
}


def _in_out(layer: torch.nn.Module) -> tuple[int, int]:
    rows, cols = layer.weight.shape
    return (rows, cols) if type(layer).__name__ == "Conv1D" else (cols, rows)  # Conv1D keeps (in, out)


def test_default_targets_train_only_adapters_and_checkpoints_round_trip(hf_family, tmp_path):
    module, fresh = hf_zoo.hf_module(hf_family), hf_zoo.hf_module(hf_family)
    base = {k: v.clone() for k, v in module.state_dict().items()}
    callback = LowRankAdapters(r=4)
    saver = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2)
    trainer = L.Trainer(
        max_steps=2,
        callbacks=[callback, saver],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    trainer.fit(module, hf_zoo.hf_data(hf_family, seq_len=16, batch_size=2))

    leaves, count = EXPECTED_LEAVES[hf_family]
    wrapped = callback.report.wrapped
    assert {name.rsplit(".", 1)[-1] for name in wrapped} == leaves and len(wrapped) == count
    expected_trainable = sum(4 * sum(_in_out(fresh.get_submodule(name))) for name in wrapped)  # r * (in + out)
    assert callback.report.trainable_params == expected_trainable
    assert sum(p.numel() for p in module.parameters() if p.requires_grad) == expected_trainable
    in_optimizer = sum(p.numel() for group in trainer.optimizers[0].param_groups for p in group["params"])
    assert in_optimizer == expected_trainable
    state = module.state_dict()
    transposed = {
        f"{name}.weight" for name, layer in lora_layers(module).items() if layer.fan_in_fan_out
    }  # GPT-2 Conv1D
    for key, value in base.items():
        assert torch.equal(state[key], value.t() if key in transposed else value), (
            f"{hf_family}: base tensor {key} changed"
        )
    assert any(layer.lora_B.abs().sum() > 0 for layer in lora_layers(module).values())  # adapters trained

    path = next(tmp_path.glob("*.ckpt"))
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert saved and all(key.endswith(ADAPTER_SUFFIXES) for key in saved)  # adapters only
    report = load_adapters(fresh, path)
    assert report.wrapped == wrapped and report.trainable_params == expected_trainable
    batch = hf_zoo.hf_batch(hf_family, seq_len=16, batch_size=2)
    module.eval(), fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(**batch).logits, module(**batch).logits, atol=0, rtol=0)


def test_a_target_that_matches_nothing_lists_the_real_layer_names(hf_family):
    module = hf_zoo.hf_module(hf_family)
    leaves = sorted(
        EXPECTED_LEAVES[hf_family][0]
        | {"lm_head", "decoder"}
        & {"gpt2": {"lm_head"}, "llama": {"lm_head"}, "bert": {"decoder"}, "t5": {"lm_head"}}[hf_family]
    )
    wrong = "c_attn" if hf_family != "gpt2" else "q_proj"
    with pytest.raises(
        ValueError,
        match=rf"pattern '{wrong}' matches no nn.Linear / Conv1D / nn.Conv2d / nn.MultiheadAttention "
        rf"layer of HFLanguageModel; its layers end in: {leaves}".replace("[", r"\[").replace("]", r"\]"),
    ):
        apply_lora_(module, target=[wrong])
    assert not lora_layers(module)  # nothing wrapped
