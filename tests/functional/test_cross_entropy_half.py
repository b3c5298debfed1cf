"""The bf16 one-pass path (``functional/cross_entropy/half.py``): the forward keeps the last tokens' logits'
gradient, the backward recomputes the others' only; the same gradients, bit for bit, as recomputing all; as
accurate as the unchunked bf16 loss; the memory of one fp32 softmax chunk; invalid targets raise."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_lowmem.functional.cross_entropy import linear_cross_entropy
from lightning_lowmem.functional.cross_entropy.half import (
    fused_loss_and_hidden_grad,
    weight_and_bias_grads,
    work_rows,
)
from lightning_lowmem.memory import track_memory


def _inputs(tokens=64, hidden=16, vocab=300, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    h = torch.randn(tokens, hidden).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden) * 0.3).to(dtype).requires_grad_()
    targets = torch.randint(vocab, (tokens,))
    targets[:3] = -100
    return h, w, targets


@pytest.mark.parametrize("grad_output", [1.0, 0.25, 2.0, 0.3])
def test_kept_rows_are_not_recomputed_in_backward(grad_output):
    """64 tokens, chunk_size 16: the work block is 8 rows, so the forward keeps 2 * (16 - 8) = 16 tokens' gradient
    and the backward recomputes 48 tokens' logits (all 64 for a grad_output not a power of two, which the kept
    gradient cannot be scaled by exactly); its weight-gradient matmul runs over all 64 tokens."""
    h, w, targets = _inputs()
    tokens, hidden, vocab = 64, 16, 300
    assert work_rows(vocab, 16) == 8
    loss = linear_cross_entropy(h, w, targets, chunk_size=16)
    with FlopCounterMode(display=False) as counter:
        loss.backward(torch.tensor(grad_output))
    recomputed = 64 if grad_output == 0.3 else 48
    assert counter.get_total_flops() == 2 * hidden * vocab * (recomputed + tokens)
    reference_h, reference_w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.cross_entropy((reference_h @ reference_w.T).float(), targets).backward(torch.tensor(grad_output))
    for ours, theirs in ((h.grad, reference_h.grad), (w.grad, reference_w.grad)):
        assert ((ours.float() - theirs.float()).norm() / theirs.float().norm()) < 5e-3


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("rows", [(16, 16), (16, 7), (64, 64)])  # part, a few, all tokens kept
def test_kept_gradient_equals_the_recomputed_one_bit_for_bit(smoothing, rows):
    h, w, targets = _inputs()
    counted = targets != -100
    safe = torch.where(counted, targets, 0)
    columns = 75
    args = (h.detach(), w.detach(), None, safe, counted, smoothing, "mean", rows, torch.bfloat16)
    kept = fused_loss_and_hidden_grad(*args, cache_columns=columns)
    plain = fused_loss_and_hidden_grad(*args)
    assert plain[4] is None and kept[4] is not None
    assert kept[4].first == 64 - min(64, 2 * (rows[1] - work_rows(300, rows[1])))
    for ours, theirs in zip(kept[:4], plain[:4], strict=True):
        assert torch.equal(ours, theirs)

    def weight_grad(cache):
        stats = (plain[1], plain[2])
        grads = weight_and_bias_grads(
            h.detach(), w.detach(), None, safe, counted, stats, smoothing, "mean", columns, torch.tensor(1.0),
            (True, False), cache,
        )  # fmt: skip
        return grads[0]

    assert torch.equal(weight_grad(kept[4]), weight_grad(None))
    assert all(part is None for part in kept[4].slices)  # each kept slice freed once used


@pytest.mark.parametrize(("dtype", "grad_output", "kept"), [
    (torch.bfloat16, 0.25, True), (torch.bfloat16, -8.0, True), (torch.bfloat16, 0.3, False),
    (torch.float16, 0.25, False), (torch.float16, 1.0, True),
])  # fmt: skip
def test_kept_gradient_scaled_by_a_power_of_two_equals_recomputing_bit_for_bit(dtype, grad_output, kept):
    """Lightning's ``loss / accumulate_grad_batches``: a bf16 kept gradient times a power of two has the bits of
    recomputing it at that scale; any other scale (or fp16, whose exponent range is narrow) recomputes every token."""
    h, w, targets = _inputs(dtype=dtype)
    counted = targets != -100
    safe = torch.where(counted, targets, 0)
    args = (h.detach(), w.detach(), None, safe, counted, 0.0, "mean", (16, 16), dtype)
    forward = fused_loss_and_hidden_grad(*args, cache_columns=75)

    def weight_grad(cache):
        grads = weight_and_bias_grads(
            h.detach(), w.detach(), None, safe, counted, forward[1:3], 0.0, "mean", 75, torch.tensor(grad_output),
            (True, False), cache,
        )  # fmt: skip
        return grads[0]

    assert torch.equal(weight_grad(forward[4]), weight_grad(None))
    assert all(part is None for part in forward[4].slices) == kept  # the kept slices were used (and freed)


@pytest.mark.parametrize("chunk_size", [None, 16, 64])
def test_bf16_gradients_no_less_accurate_than_the_unchunked_bf16_loss(chunk_size):
    """Against float64: the hidden and the weight gradients' errors at most the unchunked loss's on bf16 logits
    (F.cross_entropy(h @ w.T)) and on their fp32 upcast, with all, part and none of the tokens' gradient kept."""
    h0, w0, targets = _inputs(tokens=300, hidden=64, vocab=5000, dtype=torch.float32)
    exact_h, exact_w = h0.detach().double().requires_grad_(), w0.detach().double().requires_grad_()
    F.cross_entropy(exact_h @ exact_w.T, targets).backward()

    def errors(loss_of) -> list[float]:
        h, w = h0.detach().bfloat16().requires_grad_(), w0.detach().bfloat16().requires_grad_()
        loss_of(h, w).backward()
        return [
            ((ours.double() - exact.grad).norm() / exact.grad.norm()).item()
            for ours, exact in ((h.grad, exact_h), (w.grad, exact_w))
        ]

    ours = errors(lambda h, w: linear_cross_entropy(h, w, targets, chunk_size=chunk_size))
    bf16_logits = errors(lambda h, w: F.cross_entropy(h @ w.T, targets))
    upcast = errors(lambda h, w: F.cross_entropy((h @ w.T).float(), targets))
    for error, reference, reference_upcast in zip(ours, bf16_logits, upcast, strict=True):
        assert error < 5e-3 and error <= reference and error <= reference_upcast * 1.001


def test_bf16_peak_within_one_fp32_softmax_chunk_and_a_sixth_of_the_unchunked_loss():
    """2048 tokens x 32,000 classes: the forward holds a 256-token bf16 matmul chunk, a 16-row fp32 work block and
    480 tokens' kept gradient (the 256-token fp32 softmax chunk's bytes, less the work block); the backward the kept
    gradient, a slice's bf16 logits and a work block. At most 1/6 of the unchunked bf16 loss's bytes."""
    torch.manual_seed(0)
    tokens, hidden, vocab = 2048, 16, 32_000
    h = torch.randn(tokens, hidden).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden) * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(vocab, (tokens,))
    inputs_and_grads = 2 * (h.numel() + w.numel()) * 2

    def peak(fn) -> int:
        with track_memory(device="cpu") as tracking:
            fn().backward()
        h.grad = w.grad = None
        return tracking.report.peak_bytes - inputs_and_grads

    unchunked = peak(lambda: F.cross_entropy(h @ w.T, targets))
    chunked = peak(lambda: linear_cross_entropy(h, w, targets))
    fp32_softmax_chunk, matmul_chunk = 256 * vocab * 4, 256 * vocab * 2
    assert chunked <= unchunked / 6
    # + per-token vectors (fp32 statistics, scales, targets) and the backward's work block (131 rows of 4000)
    assert matmul_chunk + fp32_softmax_chunk <= chunked <= matmul_chunk + fp32_softmax_chunk + 96 * tokens


@pytest.mark.parametrize("bad", [300, -1])
def test_bf16_invalid_targets_raise_like_f_cross_entropy(bad):
    h, w, targets = _inputs()
    targets[5] = bad
    with pytest.raises(IndexError):
        F.cross_entropy(h @ w.T, targets)
    with pytest.raises(IndexError, match=rf"`targets` holds class index {bad}, outside \[0, 300\)"):
        linear_cross_entropy(h, w, targets)
