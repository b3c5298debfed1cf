"""checkpoint_ / uncheckpoint_: exact gradients, policy resolution, memory cut, exact undo, bad input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.demo.charlm import MLP, Block, CharGPT, GPTConfig
from lightning_lowmem.functional.checkpointing import checkpoint_, checkpointed_modules, resolve_policy, uncheckpoint_
from lightning_lowmem.memory import measure_memory
from lightning_lowmem.warnings import NoEffectWarning


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops on a shared CPU run ~20x faster single-threaded (no waiting for a busy second core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gpt(n_layer: int = 2, dropout: float = 0.0, n_embd: int = 32, block_size: int = 16) -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=n_embd, block_size=block_size, dropout=dropout))


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx)  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx.roll(-1, 1).reshape(-1))


def _grads(model: nn.Module, idx: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = _loss(model, idx)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_gradients_equal_baseline_exactly(dropout):
    model = _gpt(n_layer=3, dropout=dropout)
    idx = torch.randint(0, 256, (4, 16))
    base_loss, base_grads = _grads(model, idx)
    report = checkpoint_(model, "auto")
    assert report.wrapped == ["h.0", "h.1", "h.2"]
    loss, grads = _grads(model, idx)
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, base_grads, strict=True))  # dropout RNG is replayed too


POLICIES = [
    ("auto", ["h.0", "h.1", "h.2", "h.3"]),
    (1, ["h.0", "h.1", "h.2", "h.3"]),
    (2, ["h.0", "h.2"]),
    ("3", ["h.0", "h.3"]),
    ("Block", ["h.0", "h.1", "h.2", "h.3"]),
    ("lightning_lowmem.demo.charlm.MLP", ["h.0.mlp", "h.1.mlp", "h.2.mlp", "h.3.mlp"]),
    (Block, ["h.0", "h.1", "h.2", "h.3"]),
    ((MLP, nn.LayerNorm), [f"h.{i}.{n}" for i in range(4) for n in ("ln_1", "ln_2", "mlp")] + ["ln_f"]),
    ("h.*", ["h.0", "h.1", "h.2", "h.3"]),  # fnmatch; outermost only (h.0.attn is inside h.0)
    ("*.attn", ["h.0.attn", "h.1.attn", "h.2.attn", "h.3.attn"]),
    (r"h\.[0-1]", ["h.0", "h.1"]),  # no fnmatch hit: full-match regex
    (["h.3", "ln_f", "MLP"], ["h.0.mlp", "h.1.mlp", "h.2.mlp", "h.3", "ln_f"]),  # union, h.3.mlp inside h.3
    (["Block", "MLP"], ["h.0", "h.1", "h.2", "h.3"]),
]


@pytest.mark.parametrize(("policy", "expected"), POLICIES, ids=[repr(p) for p, _ in POLICIES])
def test_policy_selects_expected_modules(policy, expected):
    model = _gpt(n_layer=4)
    assert resolve_policy(model, policy) == expected
    assert checkpoint_(model, policy).wrapped == expected
    assert checkpointed_modules(model) == expected


def test_auto_picks_the_largest_repeated_class():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
            self.big = nn.ModuleList([nn.Sequential(nn.Linear(8, 8)) for _ in range(2)])
            self.single = nn.ModuleList([nn.Linear(100, 100)])  # not repeated

    assert resolve_policy(Net(), "auto") == ["big.0", "big.1"]


def test_checkpointing_cuts_charlm_activation_bytes_3x():
    model = _gpt(n_layer=6, n_embd=64, block_size=64)
    idx = torch.randint(0, 256, (16, 64))

    def step() -> None:
        _loss(model, idx).backward()

    base = measure_memory(step, module=model)
    checkpoint_(model, "Block")
    model.zero_grad(set_to_none=True)
    wrapped = measure_memory(step, module=model)
    ratio = base.breakdown["activations"] / wrapped.breakdown["activations"]
    assert ratio >= 3.0, f"activations {base.breakdown['activations']} -> {wrapped.breakdown['activations']}"
    assert wrapped.peak_bytes < base.peak_bytes


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_nested_checkpointing_keeps_gradients_exact(dropout):
    model = _gpt(n_layer=2, dropout=dropout)
    idx = torch.randint(0, 256, (4, 16))
    base_loss, base_grads = _grads(model, idx)
    report = checkpoint_(model, ["Block", "*.attn", "*.mlp"], nested=True)
    assert report.wrapped == ["h.0", "h.0.attn", "h.0.mlp", "h.1", "h.1.attn", "h.1.mlp"]
    loss, grads = _grads(model, idx)
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, base_grads, strict=True))


def test_nested_checkpointing_lowers_the_backward_peak():
    model = _gpt(n_layer=4, n_embd=64, block_size=64)
    idx = torch.randint(0, 256, (16, 64))

    def step() -> None:
        _loss(model, idx).backward()
        model.zero_grad(set_to_none=True)

    checkpoint_(model, "Block")
    flat = measure_memory(step, module=model)
    checkpoint_(model, ["Block", "*.attn"], nested=True)  # adds the inner wraps
    assert checkpointed_modules(model) == [name for i in range(4) for name in (f"h.{i}", f"h.{i}.attn")]
    nested = measure_memory(step, module=model)
    assert nested.phases["backward"]["peak_bytes"] < flat.phases["backward"]["peak_bytes"]


def test_uncheckpoint_restores_exactly():
    model = _gpt()
    keys = list(model.state_dict())
    custom = model.ln_f.forward = lambda x: x * 2  # an instance-level forward that existed before
    checkpoint_(model, ["Block", "ln_f"])
    assert list(model.state_dict()) == keys  # names unchanged while wrapped
    assert sorted(uncheckpoint_(model, ["h.1"])) == ["h.1"]
    assert checkpointed_modules(model) == ["h.0", "ln_f"]
    assert sorted(uncheckpoint_(model)) == ["h.0", "ln_f"]
    assert "forward" not in model.h[0].__dict__
    assert model.ln_f.forward is custom
    assert checkpointed_modules(model) == []


def test_second_call_does_not_wrap_twice():
    model = _gpt()
    assert checkpoint_(model, "auto").wrapped == ["h.0", "h.1"]
    assert checkpoint_(model, "Block").wrapped == []
    assert uncheckpoint_(model) == ["h.0", "h.1"]


def test_deepcopy_follows_the_copy_and_no_grad_runs_plain():
    model = _gpt()
    checkpoint_(model, "auto")
    clone = copy.deepcopy(model)
    assert checkpointed_modules(clone) == ["h.0", "h.1"]
    assert clone.h[0].forward.module is clone.h[0]
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(idx), clone(idx))


def test_keyword_arguments_pass_through():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return self.lin(x) * scale

    layer = Scaled()
    x = torch.randn(3, 4, requires_grad=True)
    expected = layer(x, scale=3.0)
    checkpoint_(layer, Scaled)
    out = layer(x, scale=3.0)
    out.sum().backward()
    assert torch.equal(out, expected)
    assert x.grad is not None


def test_policy_matching_nothing_is_an_error_listing_the_classes():
    model = _gpt()
    with pytest.raises(
        ValueError,
        match=r"'Blok' matched no submodule of CharGPT\. Did you mean 'Block'\? Its repeated blocks are \d+ x Block",
    ):
        checkpoint_(model, "Blok")
    with pytest.raises(ValueError, match="Conv2d matched no submodule"):
        checkpoint_(model, nn.Conv2d)
    assert checkpointed_modules(model) == []


def test_strict_false_only_warns():
    model = _gpt()
    with pytest.warns(NoEffectWarning, match="'Conv9d'"):
        report = checkpoint_(model, "Conv9d", strict=False)
    assert report.wrapped == []
    with pytest.warns(NoEffectWarning, match="'auto'"):
        checkpoint_(nn.Linear(2, 2), "auto", strict=False)
    with pytest.raises(TypeError, match="`strict` must be a bool"):
        checkpoint_(model, "Block", strict="yes")


@pytest.mark.parametrize(
    ("policy", "error", "match"),
    [
        (0, ValueError, r"`policy`=0 must be >= 1"),
        (-2, ValueError, r"`policy`=-2 must be >= 1"),
        ("", ValueError, "is empty"),
        (True, TypeError, "is a bool"),
        (2.5, TypeError, r"`policy`=2.5 \(float\) is not supported"),
        (int, TypeError, "is not an nn.Module subclass"),
        ([["Block"]], TypeError, "nests lists"),
        ([], TypeError, "is not supported"),
    ],
)
def test_bad_policy_raises(policy, error, match):
    with pytest.raises(error, match=match):
        checkpoint_(_gpt(), policy)


def test_bad_nested_raises():
    with pytest.raises(TypeError, match="`nested` must be a bool, got str: 'yes'"):
        checkpoint_(_gpt(), "Block", nested="yes")


def test_bad_module_raises():
    with pytest.raises(TypeError, match="`module` must be an nn.Module, got str"):
        checkpoint_("model", "auto")
    with pytest.raises(TypeError, match="`module` must be an nn.Module, got int"):
        uncheckpoint_(3)


def test_a_policy_matching_nothing_names_the_repeated_block_never_the_model_holding_them():
    from lightning_lowmem.demo.hf import build_hf_model

    model = build_hf_model("llama")
    with pytest.raises(
        ValueError, match=r"Did you mean 'LlamaDecoderLayer'\? Its repeated blocks are 2 x LlamaDecoderLayer"
    ) as info:
        checkpoint_(model, "LlamaBlock")
    assert "LlamaModel" not in str(info.value)  # it holds every block: checkpointing it recomputes the whole model
    assert checkpointed_modules(model) == []


def test_auto_on_a_one_block_model_checkpoints_that_block():
    model = CharGPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    assert checkpoint_(model, "auto").wrapped == ["h.0"]
    batch = torch.randint(0, 65, (2, 16))
    plain = CharGPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    plain.load_state_dict({k: v for k, v in model.state_dict().items()})
    for m in (model, plain):
        m(batch).float().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
