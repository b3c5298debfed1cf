"""linear_cross_entropy / chunked_cross_entropy / chunk_cross_entropy_: same loss and gradients as the unchunked
expression, the whole logits never alive, Hugging Face causal LMs routed with no change, clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_lowmem.functional.cross_entropy import (
    DeferredLogits,
    LogitsNotComputedError,
    chunk_cross_entropy_,
    chunked_cross_entropy,
    default_chunk_size,
    linear_cross_entropy,
)
from lightning_lowmem.memory import track_memory


def _inputs(dtype=torch.float64, bias=False, tokens=(3, 37), hidden=16, vocab=101, seed=0):
    torch.manual_seed(seed)
    h = torch.randn(*tokens, hidden, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, dtype=dtype) * 0.3).requires_grad_()
    b = torch.randn(vocab, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(vocab, tokens)
    targets.view(-1)[:5] = -100  # ignored
    return h, w, b, targets


def _grads(loss, tensors, grad_output):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None], grad_output)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_gradients_equal_the_unchunked_expression(reduction, smoothing, bias):
    h, w, b, targets = _inputs(bias=bias)
    loss = linear_cross_entropy(h, w, targets, bias=b, reduction=reduction, label_smoothing=smoothing, chunk_size=7)
    reference = F.cross_entropy(
        F.linear(h, w, b).flatten(0, 1), targets.flatten(), reduction=reduction, label_smoothing=smoothing
    )
    if reduction == "none":
        reference = reference.view(targets.shape)
        assert loss.view(-1)[:5].abs().max() == 0  # ignored targets add nothing
    grad_output = torch.randn_like(reference) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    assert loss.shape == reference.shape
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-12)
    for ours, theirs in zip(
        _grads(loss, (h, w, b), grad_output), _grads(reference, (h, w, b), grad_output), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_float32_within_fp32_rounding_and_chunk_size_changes_nothing_but_rounding():
    h, w, _, targets = _inputs(dtype=torch.float32, tokens=(4, 64), hidden=32, vocab=1000)
    reference = F.cross_entropy((h @ w.T).flatten(0, 1), targets.flatten())
    reference_grads = _grads(reference, (h, w), torch.tensor(1.0))
    for chunk_size in (1, 13, 256, None):
        loss = linear_cross_entropy(h, w, targets, chunk_size=chunk_size)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
        for ours, theirs in zip(_grads(loss, (h, w), torch.tensor(1.0)), reference_grads, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_mean_over_no_counted_target_is_nan_like_f_cross_entropy():
    h, w, _, targets = _inputs()
    targets.fill_(-100)
    assert torch.isnan(linear_cross_entropy(h, w, targets))
    assert torch.isnan(F.cross_entropy((h @ w.T).flatten(0, 1), targets.flatten()))


@pytest.mark.parametrize("mode", ["bf16 inputs", "bf16 autocast"])
def test_bf16_gradients_as_accurate_as_the_unchunked_bf16_step(mode):
    """fp32 loss and fp32 accumulation: no less accurate (vs float64) than the unchunked bf16 expression (hidden
    and weight gradients: a slice's matmul is accumulated in fp32 and rounded once, scaled before rounding)."""
    h0, w0, _, targets = _inputs(dtype=torch.float32, tokens=(300,), hidden=64, vocab=5000)
    exact_h, exact_w = h0.detach().double().requires_grad_(), w0.detach().double().requires_grad_()
    exact = _grads(
        F.cross_entropy(exact_h @ exact_w.T, targets), (exact_h, exact_w), torch.tensor(1.0, dtype=torch.float64)
    )

    def run(chunked: bool):
        cast = (lambda t: t.detach().bfloat16()) if mode == "bf16 inputs" else (lambda t: t.detach().clone())
        h, w = cast(h0).requires_grad_(), cast(w0).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16 autocast"):
            loss = (
                linear_cross_entropy(h, w, targets, chunk_size=64)
                if chunked
                else F.cross_entropy((h @ w.T).float(), targets)
            )
        assert loss.dtype == torch.float32
        grads = _grads(loss, (h, w), torch.tensor(1.0))
        assert grads[1].dtype == w.dtype
        return [((g.double() - e).norm() / e.norm()).item() for g, e in zip(grads, exact, strict=True)]

    ours, theirs = run(True), run(False)
    for error, reference_error in zip(ours, theirs, strict=True):  # each slice accumulated in fp32 first
        assert error < 5e-3 and error <= reference_error * 1.001


def test_peak_under_a_sixth_of_the_unchunked_loss():
    """2048 tokens x 32,000 classes (fp32 logits 250 MiB): the loss's own bytes (above its inputs and the
    gradients it returns) at most 1/6 of F.cross_entropy's on the materialised logits."""
    torch.manual_seed(0)
    tokens, hidden, vocab = 2048, 64, 32_000
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.05).requires_grad_()
    targets = torch.randint(vocab, (tokens,))
    inputs_and_grads = 2 * (h.numel() + w.numel()) * 4

    def peak(fn) -> int:
        with track_memory(device="cpu") as tracking:
            fn().backward()
        h.grad = w.grad = None
        return tracking.report.peak_bytes - inputs_and_grads

    unchunked = peak(lambda: F.cross_entropy(h @ w.T, targets))
    chunked = peak(lambda: linear_cross_entropy(h, w, targets))
    logits_bytes = tokens * vocab * 4
    assert unchunked >= 2 * logits_bytes  # logits + log-softmax (+ their gradient)
    assert chunked <= unchunked / 6
    assert chunked <= logits_bytes / 4  # no whole-logits tensor, ever


def test_default_chunk_size_keeps_a_chunk_to_an_eighth():
    assert default_chunk_size(2048, 32_000) * 32_000 * 4 <= 2048 * 32_000 * 4 / 8
    assert default_chunk_size(8192, 128_256) * 128_256 * 4 <= 32 * 2**20
    assert default_chunk_size(16, 100) == 16  # small logits: one chunk
    assert default_chunk_size(0, 100) == 1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"chunk_size": 0}, ValueError, r"`chunk_size`=0 must be a positive int"),
        ({"chunk_size": True}, ValueError, r"`chunk_size`=True"),
        ({"reduction": "avg"}, ValueError, r"`reduction`='avg' is not one of"),
        ({"label_smoothing": 1.5}, ValueError, r"`label_smoothing`=1.5 must be a number in \[0, 1\]"),
        ({"bias": torch.zeros(3)}, ValueError, r"`bias` must be a \(101,\) tensor"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    h, w, _, targets = _inputs()
    with pytest.raises(error, match=match):
        linear_cross_entropy(h, w, targets, **kwargs)


def test_bad_shapes():
    h, w, _, targets = _inputs()
    with pytest.raises(ValueError, match=r"`hidden` \(3, 37, 16\) must end in the weight's hidden size 8"):
        linear_cross_entropy(h, w[:, :8], targets)
    with pytest.raises(ValueError, match=r"`targets` \(3, 36\) must have hidden's leading shape \(3, 37\).*shift"):
        linear_cross_entropy(h, w, targets[:, 1:])
    with pytest.raises(TypeError, match=r"`targets` must hold integer class indices, got dtype torch.float32"):
        linear_cross_entropy(h, w, targets.float())


# ----------------------------------------------------------------------------- deferred logits on a plain model
class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 8) -> None:
        super().__init__()
        self.body, self.lm_head = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(ids))


def test_plain_model_one_line_change_gives_the_same_gradients():
    torch.manual_seed(0)
    model, ids = TinyLM(), torch.randint(50, (2, 9))

    def grads() -> list[torch.Tensor]:
        model.zero_grad()
        logits = model(ids)
        chunked_cross_entropy(logits[:, :-1], ids[:, 1:], chunk_size=3).backward()  # shifted, as a causal LM
        return [p.grad.clone() for p in model.parameters()]

    reference = grads()
    handle = chunk_cross_entropy_(model, chunk_size=3)
    assert handle.heads == ["lm_head"] and handle.losses == []
    assert isinstance(model(ids), DeferredLogits)
    for ours, theirs in zip(grads(), reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    model.eval()
    assert isinstance(model(ids), torch.Tensor)  # evaluation computes real logits
    model.train()
    handle.undo()
    assert "forward" not in model.lm_head.__dict__ and isinstance(model(ids), torch.Tensor)


def test_deferred_logits_used_as_a_tensor_name_the_one_line_change():
    model, ids = TinyLM(), torch.randint(50, (2, 9))
    chunk_cross_entropy_(model)
    logits = model(ids)
    assert logits.shape == (2, 9, 50)
    for use in (
        lambda: logits.argmax(-1),
        lambda: F.cross_entropy(logits, ids),
        lambda: logits[..., 3],
        lambda: torch.softmax(logits, -1),
    ):
        with pytest.raises(LogitsNotComputedError, match=r"chunked_cross_entropy\(logits, targets\)"):
            use()


def test_no_head_and_bad_heads_are_refused_before_any_change():
    with pytest.raises(ValueError, match=r"no output head found in Sequential.*Name it with `head=`.*\['0', '2'\]"):
        chunk_cross_entropy_(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3)))
    with pytest.raises(ValueError, match=r"`head`='decoder' names no submodule"):
        chunk_cross_entropy_(nn.Sequential(nn.Linear(4, 4)), head="decoder")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    assert chunk_cross_entropy_(model, head="1").heads == ["1"]


def test_lora_wrapped_head_is_refused():
    from lightning_lowmem.functional.lora import apply_lora_

    model = TinyLM()
    apply_lora_(model, r=2, target=["lm_head"])
    with pytest.raises(ValueError, match=r"`lm_head` is a LoraLinear.*plain nn.Linear head"):
        chunk_cross_entropy_(model)
    assert "forward" not in model.lm_head.__dict__


def test_bf16_matmul_chunk_larger_than_its_fp32_softmax_chunk_changes_nothing():
    """bf16: a matmul over 12 tokens' logits, their fp32 softmax 5 tokens at a time: the same loss, log-sum-exp and
    hidden gradient, bit for bit, as the softmax over all 12 at once."""
    from lightning_lowmem.functional.cross_entropy.half import fused_loss_and_hidden_grad

    h, w, _, targets = _inputs(dtype=torch.bfloat16, tokens=(30,), hidden=16, vocab=300)
    counted = targets != -100
    safe = torch.where(counted, targets, 0)
    split, whole = (
        fused_loss_and_hidden_grad(h.detach(), w.detach(), None, safe, counted, 0.1, "mean", rows, torch.bfloat16)
        for rows in ((12, 5), (12, 12))
    )
    for ours, theirs in zip(split[:4], whole[:4], strict=True):
        assert torch.equal(ours, theirs)
    reference = F.cross_entropy((h.detach().float() @ w.detach().float().T), targets, label_smoothing=0.1)
    torch.testing.assert_close(split[0], reference, rtol=2e-2, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bf16_one_pass_with_bias_smoothing_and_a_grad_output_matches_the_upcast_loss(reduction):
    """bf16 weights (the hidden gradient in forward, the weight's and the bias' recomputed in backward): loss and all
    three gradients as the unchunked loss on fp32-upcast logits, within bf16 rounding."""
    h, w, b, targets = _inputs(dtype=torch.bfloat16, bias=True, tokens=(40,), hidden=16, vocab=300)
    loss = linear_cross_entropy(h, w, targets, bias=b, reduction=reduction, label_smoothing=0.1, chunk_size=7)
    reference = F.cross_entropy(F.linear(h, w, b).float(), targets, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    grad_output = torch.tensor(2.0)
    ours_all, theirs_all = _grads(loss, (h, w, b), grad_output), _grads(reference, (h, w, b), grad_output)
    for ours, theirs in zip(ours_all, theirs_all, strict=True):
        assert ours.dtype == torch.bfloat16
        assert ((ours.float() - theirs.float()).norm() / theirs.float().norm()) < 5e-3
