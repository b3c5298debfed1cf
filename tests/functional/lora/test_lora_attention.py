"""LoRA on nn.MultiheadAttention for real (LoraMultiheadAttention): in_proj_weight (Q / K / V) and out_proj are adapted
through the weights F.multi_head_attention_forward reads; exact at step 0, trained, right in eval / no_grad (the fused
fast path is kept off), merged and undone exactly, inside nn.TransformerEncoder and nn.Transformer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.applied import apply
from lightning_lowmem.functional.config import TrainingConfig
from lightning_lowmem.functional.lora import apply_lora_, load_adapters, merge_lora_, merged_state_dict, save_adapters
from lightning_lowmem.functional.lora.layers import LoraMultiheadAttention, lora_layers
from lightning_lowmem.warnings import NoEffectWarning
from tests.vision_zoo import mha_classifier, token_batch, transformer_seq2seq

TOKENS, LABELS = token_batch()


def _step(model):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(TOKENS), LABELS).backward()
    optimizer.step()


def _randomise(model):
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.1)


def test_exact_at_step_zero_in_train_and_in_eval_no_grad():
    model = mha_classifier()
    train_reference = model(TOKENS)
    model.eval()
    with torch.no_grad():
        eval_reference = model(TOKENS)  # nn.TransformerEncoderLayer's fused fast path
    model.train()
    apply_lora_(model, r=4)
    assert all(isinstance(layer.self_attn, LoraMultiheadAttention) for layer in model.encoder.layers)
    assert torch.equal(model(TOKENS), train_reference)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), eval_reference, atol=1e-5, rtol=0)


def test_in_proj_and_out_proj_adapters_get_gradients_and_count_exactly():
    model = mha_classifier()  # width 32, 2 layers, feed-forward 64
    report = apply_lora_(model, r=4, train_modules=None)
    nn.functional.cross_entropy(model(TOKENS), LABELS).backward()
    attention = model.encoder.layers[0].self_attn
    assert attention.lora_B.grad.abs().sum() > 0 and attention.out_proj.lora_B.grad.abs().sum() > 0
    assert attention.in_proj_weight.grad is None and attention.out_proj.weight.grad is None  # the base stays frozen
    # per layer, r * (in + out): in_proj 32 -> 96, out_proj 32 -> 32, linear1 32 -> 64, linear2 64 -> 32
    assert report.trainable_params == 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 64) + (64 + 32))


def test_adapters_apply_in_eval_no_grad_and_merge_to_the_plain_model():
    model = mha_classifier()
    apply_lora_(model, r=4, train_modules=None)
    _randomise(model)
    model.eval()
    with torch.no_grad():
        adapted = model(TOKENS)
        assert not torch.allclose(adapted, mha_classifier().eval()(TOKENS), atol=1e-3)  # the adapters act here too
        plain = mha_classifier().eval()
        plain.load_state_dict(merged_state_dict(model), strict=True)  # in_proj_weight key, no adapter keys
        torch.testing.assert_close(plain(TOKENS), adapted, atol=1e-5, rtol=0)  # plain: the fused fast path
        assert merge_lora_(model) == 8  # 2 x (in_proj, out_proj, linear1, linear2)
        torch.testing.assert_close(model(TOKENS), adapted, atol=1e-5, rtol=0)


def test_undo_restores_the_state_dict_bit_exactly_after_training():
    model = mha_classifier()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    attention = model.encoder.layers[0].self_attn
    applied = apply(model, TrainingConfig(lora={"r": 4}, optimizer="sgd"))
    assert model.encoder.layers[0].self_attn is not attention
    _step(model)
    applied.undo()
    assert model.encoder.layers[0].self_attn is attention and type(attention) is nn.MultiheadAttention
    assert type(attention.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[key], value) for key, value in before.items())
    assert all(p.requires_grad for p in model.parameters())


def test_nn_transformer_self_and_cross_attention_train():
    model = transformer_seq2seq()
    report = apply_lora_(model, r=2, target=["self_attn", "multihead_attn", "out_proj"])
    assert len(report.wrapped) == 2 * 2 + 2 * 4  # encoder: self; decoder: self and cross -- each in_proj + out_proj
    _step(model)
    assert all(layer.lora_B.abs().sum() > 0 for layer in lora_layers(model).values())


def test_out_proj_alone_in_proj_pattern_and_dropout_warning():
    model = mha_classifier()
    report = apply_lora_(model, r=2, target="in_proj_weight", train_modules=None)
    assert report.wrapped == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    assert type(model.encoder.layers[0].self_attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    with pytest.warns(NoEffectWarning, match=r"`dropout`=0.1 does not apply to the adapters of the nn.MultiheadAtt"):
        apply_lora_(mha_classifier(), r=2, dropout=0.1)
    with pytest.raises(
        ValueError, match=r"stores the frozen base of linear layers only; \['encoder.layers.0.self_attn'"
    ):
        apply_lora_(mha_classifier(), r=2, quantize_base="int8")


def test_adapter_file_round_trip(tmp_path):
    model = mha_classifier()
    apply_lora_(model, r=4, train_modules=["head"])
    _step(model)
    save_adapters(model, tmp_path / "adapters.pt")
    fresh = mha_classifier()
    report = load_adapters(fresh, tmp_path / "adapters.pt")
    assert len(report.wrapped) == 8 and isinstance(fresh.encoder.layers[1].self_attn, LoraMultiheadAttention)
    torch.testing.assert_close(fresh(TOKENS), model(TOKENS), atol=0, rtol=0)


def test_masks_and_attention_weights_as_the_original():
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(16, 2, batch_first=True, kdim=8, vdim=8, add_bias_kv=True)
    query, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 8)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[0, -2:] = True
    expected = attention(query, memory, memory, key_padding_mask=padding)
    wrapped = LoraMultiheadAttention.from_module(attention, in_proj=False, r=2, alpha=4.0)  # separate q/k/v weights
    for got, want in zip(wrapped(query, memory, memory, key_padding_mask=padding), expected, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="in_proj_weight is None"):
        LoraMultiheadAttention.from_module(attention, in_proj=True, r=2, alpha=4.0)


def test_estimate_memory_of_lora_on_nn_transformer_equals_the_measured_step():
    import warnings

    from lightning_lowmem.memory import measure_memory
    from lightning_lowmem.planning.estimate import _train_step, default_loss, estimate_memory

    batch = (TOKENS, LABELS)
    config = TrainingConfig(lora={"r": 4}, optimizer="adamw")
    estimate = estimate_memory(transformer_seq2seq(), batch, device="cpu", config=config)
    model = transformer_seq2seq()
    optimizer = apply(model, config).build_optimizer()
    loop = estimate.meta["loop"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train_step(model, batch, default_loss, optimizer, config, None, loop=loop)
        measured = measure_memory(
            _train_step, model, batch, default_loss, optimizer, config, None, loop=loop, module=model
        )
    assert estimate.peak_bytes == measured.peak_bytes
    assert len(lora_layers(model)) == 2 * 4 + 2 * 6  # encoder: in_proj, out_proj, linear1, linear2; decoder: + cross


def test_nested_tensor_fast_path_of_nn_transformer_encoder_is_off_while_adapted_and_back_on_undo():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2).eval()  # enable_nested_tensor=True: packs padded batches in eval
    x, padding = torch.randn(3, 6, 32), torch.zeros(3, 6, dtype=torch.bool)
    padding[0, -2:] = True
    with torch.no_grad():
        reference = encoder(x, src_key_padding_mask=padding)
    applied = apply(encoder, TrainingConfig(lora={"r": 2}))
    assert encoder.use_nested_tensor is False
    _randomise(encoder)
    with torch.no_grad():  # used to fail: "Nested tensor dimension 0 cannot be transposed"
        adapted = encoder(x, src_key_padding_mask=padding)
    assert not torch.allclose(adapted[~padding], reference[~padding], atol=1e-3)  # the adapters act
    applied.undo()
    assert encoder.use_nested_tensor is True
    with torch.no_grad():
        torch.testing.assert_close(encoder(x, src_key_padding_mask=padding), reference, atol=0, rtol=0)


def test_lowrankadapters_trains_the_attention_adapters_and_plan_memory_takes_lora(tiny_trainer_kwargs):
    import lightning as L

    from lightning_lowmem.callbacks.low_rank_adapters import LowRankAdapters
    from lightning_lowmem.planning.plan import plan_memory

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = mha_classifier()

        def training_step(self, batch, batch_idx):
            tokens, labels = batch
            return nn.functional.cross_entropy(self.model(tokens), labels)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(TOKENS, LABELS), batch_size=2)
    module, callback = Classifier(), LowRankAdapters(r=2, train_modules=["head"])
    L.Trainer(max_steps=2, callbacks=[callback], **tiny_trainer_kwargs).fit(module, data)
    attention = module.model.encoder.layers[0].self_attn
    assert "model.encoder.layers.0.self_attn" in callback.report.wrapped
    assert attention.lora_B.abs().sum() > 0 and attention.out_proj.lora_B.abs().sum() > 0
    plan = plan_memory(
        mha_classifier(), (TOKENS, LABELS), 8 * 2**20, device="cpu", micro_batch_sizes=[None], loras=[{"r": 4}]
    )
    assert plan.config.lora is not None and plan.predicted_peak_bytes <= plan.usable_bytes


def test_a_bare_attention_or_layer_is_refused_with_the_fix():
    with pytest.raises(
        ValueError, match=r"`module` is itself the MultiheadAttention to adapt; .*nn.Sequential\(layer\)"
    ):
        apply_lora_(nn.MultiheadAttention(8, 2), target="out_proj")
    model = nn.Sequential(nn.MultiheadAttention(8, 2))  # no linear layer but its projections: "all-linear" adapts them
    assert apply_lora_(model, r=2).wrapped == ["0", "0.out_proj"]
