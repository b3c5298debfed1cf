"""Tied embeddings under the chunked loss: one (V, H) gradient buffer, the unchunked gradients, one optimizer
step in backward; invalid targets raise; the meter and the estimator agree with a run without them (peak RSS)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_lowmem.functional.cross_entropy import chunk_cross_entropy_, chunked_cross_entropy, linear_cross_entropy
from lightning_lowmem.functional.optimizers.in_backward import OptimizerInBackward
from lightning_lowmem.memory import track_memory


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 300, width: int = 16, padding_idx: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=padding_idx)
        self.body = nn.Linear(width, width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.body(self.embed(ids))))


def _pair(**kwargs):
    torch.manual_seed(0)
    reference = TiedLM(**kwargs)
    chunked = TiedLM(**kwargs)
    chunked.load_state_dict(reference.state_dict())
    report = chunk_cross_entropy_(chunked, chunk_size=5)
    return reference, chunked, report


def _batch(vocab: int = 300):
    torch.manual_seed(1)
    ids, targets = torch.randint(vocab, (3, 20)), torch.randint(vocab, (3, 20))
    ids[0, :4] = 0  # the padding row, when there is one
    targets[0, :3] = -100
    return ids, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_tied_gradient_equals_the_unchunked_reference(dtype, padding_idx):
    reference, chunked, report = _pair(padding_idx=padding_idx)
    reference.to(dtype), chunked.to(dtype)
    assert report.tied_embeddings == ["embed"]
    ids, targets = _batch()
    F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten()).backward()
    chunked_cross_entropy(chunked(ids), targets).backward()
    tolerance = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    for (name, ours), theirs in zip(chunked.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, **tolerance, msg=name)


def test_tied_weight_holds_one_gradient_at_the_peak():
    """V=20,000 x H=64 fp32 (4.9 MiB per (V, H) buffer): the step's bytes above the parameters hold one such
    buffer (the gradient) plus a chunk of logits, where autograd alone makes two (head's and embedding's)."""
    vocab, width = 20_000, 64
    model = TiedLM(vocab, width)
    ids, targets = torch.randint(vocab, (1, 64)), torch.randint(vocab, (1, 64))
    buffer = vocab * width * 4

    def peak() -> int:
        model.zero_grad(set_to_none=True)
        with track_memory(model, device="cpu") as tracking:
            chunked_cross_entropy(model(ids), targets, chunk_size=8).backward()
        return tracking.report.peak_bytes - tracking.report.breakdown["parameters"]

    handle = chunk_cross_entropy_(model)
    one = peak()
    handle.undo()  # the head still chunked, the embedding's backward autograd's own (dense)
    handle = chunk_cross_entropy_(model)
    handle._undo[-1](), handle.tied_embeddings.clear()
    two = peak()
    assert one < 1.25 * buffer  # the gradient + a chunk of 8 tokens' logits (0.6 MiB)
    assert two >= 2 * buffer


def test_optimizer_in_backward_steps_once_on_the_whole_tied_gradient():
    reference, chunked, _ = _pair()
    ids, targets = _batch()
    steps = []
    chunked.embed.weight.register_post_accumulate_grad_hook(lambda p: steps.append(p.grad.clone()))
    optimizer = OptimizerInBackward(chunked.parameters(), "sgd", lr=0.1)
    chunked_cross_entropy(chunked(ids), targets).backward()
    F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten()).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert len(steps) == 1
    torch.testing.assert_close(steps[0], reference.embed.weight.grad, rtol=1e-5, atol=1e-7)
    for ours, theirs in zip(chunked.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    optimizer.remove_hooks()


def test_a_loss_not_reaching_the_embedding_returns_its_own_gradient():
    """The body detached: the embedding's backward never runs, so the loss must not hand its gradient over."""
    _, chunked, _ = _pair()
    ids, targets = _batch()
    out = chunked(ids)
    hidden = out.hidden.detach()
    linear_cross_entropy(hidden, chunked.lm_head.weight, targets).backward()
    expected = torch.autograd.grad(
        F.cross_entropy((hidden @ chunked.lm_head.weight.T).flatten(0, 1), targets.flatten()), chunked.lm_head.weight
    )[0]
    torch.testing.assert_close(chunked.lm_head.weight.grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bad", [300, 1000, -1, -7])
def test_invalid_targets_raise_like_f_cross_entropy(bad):
    hidden, weight = torch.randn(4, 8), torch.randn(300, 8)
    targets = torch.tensor([1, 2, bad, -100])
    with pytest.raises(IndexError):
        F.cross_entropy(hidden @ weight.T, targets)
    with pytest.raises(IndexError, match=rf"`targets` holds class index {bad}, outside \[0, 300\)"):
        linear_cross_entropy(hidden, weight, targets)
    assert torch.isfinite(linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 299, -100])))


_PEAK_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    sys.path.insert(0, {tests!r})
    from test_cross_entropy_tied import TiedLM
    from lightning_lowmem.functional.cross_entropy import chunk_cross_entropy_, chunked_cross_entropy
    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab, width, tokens = 128_256, 256, 2048
    model = TiedLM(vocab, width)
    chunk_cross_entropy_(model)
    ids, targets = torch.randint(vocab, (1, tokens)), torch.randint(vocab, (1, tokens))
    loss_fn = lambda m, batch: chunked_cross_entropy(m(batch[0]), batch[1])
    loss_fn(model, (ids, targets)).backward()  # warm up; the second step is measured
    model.zero_grad(set_to_none=True)
    mode = sys.argv[1]
    if mode == "rss":
        def rss(field):
            return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))
        start = rss("VmRSS:")
        open("/proc/self/clear_refs", "w").write("5")
        loss_fn(model, (ids, targets)).backward()
        print(rss("VmHWM:") - start)
    elif mode == "meter":
        from lightning_lowmem.memory import measure_memory
        report = measure_memory(lambda: loss_fn(model, (ids, targets)).backward(), module=model, device="cpu")
        print(report.peak_bytes - report.breakdown["parameters"] - ids.nbytes - targets.nbytes)
    else:
        from lightning_lowmem.planning.estimate import estimate_memory
        report = estimate_memory(model, (ids, targets), loss_fn=loss_fn, optimizer="sgd", device="cpu", steps=1)
        step = max(report.phases[phase]["peak_bytes"] for phase in ("forward", "backward"))
        print(step - report.breakdown["parameters"])
    """
)


def _peak(mode: str) -> int:
    tests = os.path.dirname(__file__)
    root = os.path.dirname(os.path.dirname(tests))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": root}  # no dynamic mmap threshold
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT.format(tests=tests), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_meter_and_estimate_equal_the_peak_rss_of_a_run_without_them():
    """V=128,256, H=256, 2048 tokens, fp32, tied: a dispatch-mode meter used to see one (V, H) sum more than
    the run makes (376 MiB vs 251); with one gradient per tied weight all three agree within 2%."""
    rss, measured, estimated = _peak("rss"), _peak("meter"), _peak("estimate")
    buffer = 128_256 * 256 * 4
    assert buffer <= rss < 1.5 * buffer  # one gradient buffer, a chunk of logits
    assert abs(measured - rss) <= 0.02 * rss
    assert abs(estimated - rss) <= 0.02 * rss


def test_a_second_backward_through_the_one_pass_path_is_refused():
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.randint(40, (6,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"backward ran twice \(retain_graph=True\)"):
        loss.backward()


def test_hugging_face_llama_with_tied_embeddings_one_buffer_same_gradients():
    pytest.importorskip("transformers")
    from lightning_lowmem.demo.hf import build_hf_model

    dims = dict(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    reference = build_hf_model("llama", num_attention_heads=4, num_key_value_heads=2, **dims)
    chunked = build_hf_model("llama", num_attention_heads=4, num_key_value_heads=2, **dims)
    chunked.load_state_dict(reference.state_dict())
    assert chunked.lm_head.weight is chunked.model.embed_tokens.weight
    report = chunk_cross_entropy_(chunked, chunk_size=16)
    assert report.tied_embeddings == ["model.embed_tokens"]
    ids = torch.randint(500, (2, 24))
    reference(input_ids=ids, labels=ids).loss.backward()
    chunked(input_ids=ids, labels=ids).loss.backward()
    for (name, ours), theirs in zip(chunked.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7, msg=name)
    report.undo()
    assert "forward" not in chunked.model.embed_tokens.__dict__


def test_two_pass_loss_makes_the_tied_gradient_after_the_body_backward():
    """bf16 (the two-pass path): the (V, H) gradient is computed by the embedding's backward, so it is not alive
    while the body's backward runs (its temporaries stand in a (V, H)-sized tensor here): the step's bytes above
    the parameters hold one (V, H) buffer, not two; the gradients are the fp32 reference's within bf16 rounding."""
    vocab, width = 20_000, 64
    torch.manual_seed(0)
    model = TiedLM(vocab, width)
    reference = TiedLM(vocab, width)
    reference.load_state_dict(model.state_dict())
    model.to(torch.bfloat16)
    ids, targets = torch.randint(vocab, (1, 64)), torch.randint(vocab, (1, 64))
    buffer = vocab * width * 2
    body_temporary = []
    model.body.weight.register_post_accumulate_grad_hook(
        lambda p: body_temporary.append(float(torch.ones(vocab, width, dtype=torch.bfloat16).sum()))
    )
    chunk_cross_entropy_(model)
    with track_memory(model, device="cpu") as tracking:
        chunked_cross_entropy(model(ids), targets, chunk_size=8).backward()
    assert len(body_temporary) == 1
    assert tracking.report.peak_bytes - tracking.report.breakdown["parameters"] < 1.5 * buffer
    F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten()).backward()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        error = float((ours.grad.float() - theirs.grad).norm() / theirs.grad.norm())
        assert error < 2e-2, (name, error)  # bf16 weights and gradients against fp32 ones


def test_two_pass_deferred_tied_gradient_is_bit_identical_to_the_head_gradient_plus_the_rows():
    """The deferred weight gradient (computed in the embedding's backward) equals, bit for bit, the loss's own weight
    gradient on an untied copy with the embedding's rows added in place: deferring changes when, not what."""
    vocab, width = 3000, 32
    _, model, _ = _pair(vocab=vocab, width=width)
    model.to(torch.bfloat16)
    ids, targets = _batch(vocab)
    hidden = torch.tanh(model.body(model.embed(ids)))
    linear_cross_entropy(hidden, model.lm_head.weight, targets, chunk_size=7).backward()
    weight = model.embed.weight.detach().clone()
    head = weight.clone().requires_grad_(True)
    embedded = F.embedding(ids, weight).requires_grad_(True)
    hidden = torch.tanh(F.linear(embedded, model.body.weight.detach(), model.body.bias.detach()))
    linear_cross_entropy(hidden, head, targets, chunk_size=7).backward()
    expected = head.grad.index_add_(0, ids.reshape(-1), embedded.grad.reshape(-1, width))
    assert torch.equal(model.embed.weight.grad, expected)
