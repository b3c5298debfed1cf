"""linear_cross_entropy on a GPU: the unchunked loss and gradients (fp32 and bf16), and the allocator's peak at
2048 tokens x 32,000 classes at most 1/6 of F.cross_entropy's on the logits. GPU only (``cuda`` marker)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_lowmem.functional.cross_entropy import linear_cross_entropy

pytestmark = pytest.mark.cuda


def _peak_above(fn, baseline: int) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_to_the_unchunked_loss_and_a_sixth_of_its_peak(dtype):
    torch.manual_seed(0)
    tokens, hidden_size, vocab = 2048, 1024, 32_000
    hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, device="cuda") * hidden_size**-0.5).to(dtype).requires_grad_()
    targets = torch.randint(vocab, (tokens,), device="cuda")

    def reference() -> torch.Tensor:
        return F.cross_entropy((hidden @ weight.T).float(), targets)

    def chunked() -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, targets)

    losses, grads = [], []
    for fn in (reference, chunked):
        loss = fn()
        loss.backward()
        losses.append(loss.detach())
        grads.append((hidden.grad.float(), weight.grad.float()))
        hidden.grad = weight.grad = None
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(losses[1], losses[0], rtol=tolerance, atol=0)
    for ours, theirs in zip(grads[1], grads[0], strict=True):
        assert ((ours - theirs).norm() / theirs.norm()).item() < tolerance
    baseline = torch.cuda.memory_allocated() + 2 * (hidden.numel() + weight.numel()) * hidden.element_size()
    unchunked = _peak_above(reference, baseline)
    hidden.grad = weight.grad = None
    ours = _peak_above(chunked, baseline)
    assert ours <= unchunked / 6, (ours, unchunked)
