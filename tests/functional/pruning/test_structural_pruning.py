"""Physical channel removal: parameter counts, optimizer rebinding with sliced state, weights_only reload."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.pruning.structural import prune_structural_, pruned_shapes, restore_shapes_


def _adam_after_one_step(model: nn.Module, x: torch.Tensor) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(x).float().mean().backward()
    opt.step()
    return opt


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_convnet_half_channels_removed_and_optimizer_rebound(tiny_convnet):
    x = torch.randn(2, 1, 8, 8)
    opt = _adam_after_one_step(tiny_convnet, x)
    conv1_norms = torch.linalg.vector_norm(tiny_convnet.conv1.weight.detach().flatten(1), dim=1)
    kept = conv1_norms.topk(4).indices.sort().values  # the 4 strongest of 8 channels survive
    old_exp_avg = opt.state[tiny_convnet.conv1.weight]["exp_avg"].clone()
    old_weight = tiny_convnet.conv1.weight.detach().clone()

    report = prune_structural_(tiny_convnet, 0.5, x, optimizer=opt)

    # conv1 8->4 (+bn 4), conv2 8x16 -> 4x8 in/out, head 16 -> 8 inputs
    expected = (4 * 9 + 4) + 2 * 4 + (8 * 4 * 9 + 8) + (8 * 4 + 4)
    assert report.params_after == _num_params(tiny_convnet) == expected
    assert tiny_convnet.conv1.out_channels == 4 and tiny_convnet.bn1.running_mean.shape == (4,)
    opt_params = [p for group in opt.param_groups for p in group["params"]]
    assert {id(p) for p in opt_params} == {id(p) for p in tiny_convnet.parameters()}
    assert torch.equal(tiny_convnet.conv1.weight.detach(), old_weight[kept])
    assert torch.equal(opt.state[tiny_convnet.conv1.weight]["exp_avg"], old_exp_avg[kept])
    before = tiny_convnet.conv1.weight.detach().clone()
    tiny_convnet(x).sum().backward()
    opt.step()  # a training step still runs and updates the *new* parameters
    assert not torch.equal(tiny_convnet.conv1.weight.detach(), before)


def test_transformer_ffn_units_halved(tiny_gpt):
    x = torch.randint(0, 256, (2, 16))
    opt = _adam_after_one_step(tiny_gpt, x)
    before = _num_params(tiny_gpt)
    report = prune_structural_(tiny_gpt, 0.5, x, optimizer=opt)
    c, layers = 32, 2
    removed_per_block = (2 * c) * c + 2 * c + c * (2 * c)  # half of c_fc (weight + bias) and of c_proj's inputs
    assert before - _num_params(tiny_gpt) == layers * removed_per_block
    assert set(report.removed_channels) == {"h.0.mlp.c_fc", "h.1.mlp.c_fc"}
    assert tiny_gpt.h[0].attn.c_attn.out_features == 3 * c  # attention and residual width untouched
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in tiny_gpt.parameters()}
    loss = tiny_gpt(x).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)


class _Config:
    n_head = 2  # LitGPT keeps the head count on its config, not on the attention module


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.config, self.width = _Config(), width
        self.qkv = nn.Linear(width, 3 * width)  # fused, split by fixed sizes in forward
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (B, T, C), heads = x.shape, self.config.n_head
        q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in self.qkv(x).split(self.width, dim=-1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class _HeadFirstGPT(nn.Module):
    """LitGPT's layout: ``lm_head`` registered before the blocks, attention named by its class only."""

    def __init__(self, vocab: int = 64, width: int = 16) -> None:
        super().__init__()
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte = nn.Embedding(vocab, width)
        self.norm_1, self.norm_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width)
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        x = x + self.attn(self.norm_1(x))
        x = x + self.proj(torch.relu(self.fc(self.norm_2(x))))
        return self.lm_head(x)


def test_a_head_registered_first_and_fused_qkv_are_left_whole():
    # used to cut half the vocabulary (the "last layer" was proj) and half of qkv (its split then failed)
    torch.manual_seed(0)
    model, idx = _HeadFirstGPT(), torch.randint(0, 64, (2, 8))
    report = prune_structural_(model, 0.5, idx)
    assert report.removed_channels == {"fc": 32}
    assert model.lm_head.out_features == 64 and model.attn.qkv.out_features == 48
    assert model(idx).shape == (2, 8, 64)


def test_pruned_model_reloads_with_weights_only(tiny_convnet):
    fresh = type(tiny_convnet)()  # the unpruned architecture
    x = torch.randn(2, 1, 8, 8)
    prune_structural_(tiny_convnet, 0.5, x)
    buffer = io.BytesIO()
    torch.save({"state_dict": tiny_convnet.state_dict(), "shapes": pruned_shapes(tiny_convnet)}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    restore_shapes_(fresh, saved["shapes"]).load_state_dict(saved["state_dict"])
    tiny_convnet.eval(), fresh.eval()
    assert torch.equal(fresh(x), tiny_convnet(x))
    assert fresh.conv2.in_channels == 4


def test_bad_ratio(tiny_mlp):
    with pytest.raises(ValueError, match=r"`ratio`=1.0 must be a float in \[0, 1\)"):
        prune_structural_(tiny_mlp, 1.0, torch.randn(1, 16))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_ffn_units_halved_along_the_right_dim_and_reloaded(family):
    pytest.importorskip("transformers")
    from tests.hf_zoo import hf_batch, hf_module

    model = hf_module(
        family, **({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if family == "gpt2" else {})
    ).model
    model.eval()
    batch = hf_batch(family, seq_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**batch).loss.backward()
    opt.step()
    mlp = model.transformer.h[0].mlp if family == "gpt2" else model.model.layers[0].mlp
    first = mlp.c_fc if family == "gpt2" else mlp.gate_proj
    rows = first.weight.detach().t() if family == "gpt2" else first.weight.detach()  # (out, in) either way
    kept = torch.linalg.vector_norm(rows, dim=1).topk(rows.shape[0] // 2).indices.sort().values
    before = _num_params(model)

    report = prune_structural_(model, 0.5, batch, optimizer=opt)  # a dict batch: traced as model(**batch)

    per_block = 2 * 64 * 128 + 128 if family == "gpt2" else 3 * 64 * 64  # c_fc (+bias) + c_proj / gate, up, down
    assert before - _num_params(model) == 2 * per_block
    if family == "gpt2":  # Conv1D weight is (in, out): output units are columns
        assert mlp.c_fc.nf == 128 and mlp.c_fc.weight.shape == (64, 128) and mlp.c_proj.weight.shape == (128, 64)
        assert torch.equal(mlp.c_fc.weight.detach(), rows.t()[:, kept])
        assert model.transformer.h[0].attn.c_attn.weight.shape == (64, 192)  # attention untouched
    else:  # gate and up are one coupled group, cut once
        assert set(report.removed_channels) == {"model.layers.0.mlp.gate_proj", "model.layers.1.mlp.gate_proj"}
        assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (64, 64) and mlp.down_proj.weight.shape == (
            64,
            64,
        )
        assert torch.equal(mlp.gate_proj.weight.detach(), rows[kept])
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    loss = model(**batch).loss
    loss.backward()
    opt.step()  # training continues on the smaller model
    fresh = hf_module(family).model.eval()
    restore_shapes_(fresh, pruned_shapes(model)).load_state_dict(model.state_dict())
    assert torch.equal(fresh(**batch).logits, model(**batch).logits)
