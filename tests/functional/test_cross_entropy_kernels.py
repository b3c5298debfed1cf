"""`linear_cross_entropy(kernel=...)`: Liger-Kernel's / Cut Cross-Entropy's fused CUDA kernels as optional extras.

Neither library is installed here (their Triton kernels need CUDA): fake modules injected into ``sys.modules``
record their arguments and compute the loss with plain torch, and ``kernels.on_cuda`` is patched to call CPU
tensors CUDA ones, so the dispatch, the argument mapping, the fallbacks and the errors run on CPU.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_lowmem.functional.config import CrossEntropyConfig
from lightning_lowmem.functional.cross_entropy import chunk_cross_entropy_, chunked_cross_entropy, linear_cross_entropy
from lightning_lowmem.functional.cross_entropy import kernels

LIGER = "liger_kernel.transformers.functional"


def _plain(input, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    """The unchunked loss, in the inputs' dtype (the wrappers must hand back float32 whatever a library returns)."""
    logits = F.linear(input, weight, bias).float()
    loss = F.cross_entropy(
        logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction
    )
    return loss.to(input.dtype)


def _install(monkeypatch, name: str, **attributes) -> types.ModuleType:
    """A fake module ``name`` (and its parent packages) in ``sys.modules``."""
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
    module = sys.modules[name]
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


@pytest.fixture
def liger(monkeypatch):
    """A fake liger-kernel whose function records each call's arguments."""
    calls: list[dict] = []

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, **kwargs):
        calls.append({"input": input, "weight": weight, "target": target, "bias": bias, **kwargs})
        return _plain(input, weight, target, bias, **kwargs)

    _install(monkeypatch, LIGER, liger_fused_linear_cross_entropy=liger_fused_linear_cross_entropy)
    return calls


def _cce(monkeypatch, version: str = "25.6.4", bias: bool = True) -> list[dict]:
    """A fake cut-cross-entropy: with ``bias=False`` the PyPI 25.1 signature (no ``bias`` argument)."""
    calls: list[dict] = []

    def with_bias(e, c, targets, bias=None, ignore_index=-100, softcap=None, reduction="mean", shift=0):
        calls.append({"e": e, "c": c, "targets": targets, "bias": bias, "ignore_index": ignore_index})
        return _plain(e, c, targets, bias, ignore_index=ignore_index, reduction=reduction)

    def without_bias(e, c, targets, ignore_index=-100, softcap=None, reduction="mean", shift=False):
        return with_bias(e, c, targets, None, ignore_index, softcap, reduction)

    _install(monkeypatch, "cut_cross_entropy", linear_cross_entropy=with_bias if bias else without_bias)
    sys.modules["cut_cross_entropy"].__version__ = version
    return calls


@pytest.fixture
def cuda_like(monkeypatch):
    """CPU tensors pass for CUDA ones (what the dispatch asks of the device)."""
    monkeypatch.setattr(kernels, "on_cuda", lambda tensor: True)


@pytest.fixture(autouse=True)
def no_real_libraries(monkeypatch):
    """Whatever is installed, an uninjected library is missing (``None`` in ``sys.modules`` stops its import)."""
    for name in (LIGER, "cut_cross_entropy"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(kernels, "_MISSING", set())


def _inputs(dtype=torch.float32, bias=False):
    torch.manual_seed(0)
    hidden = torch.randn(2, 12, 8, dtype=dtype, requires_grad=True)
    weight = torch.randn(40, 8, dtype=dtype, requires_grad=True)
    targets = torch.randint(40, (2, 12))
    targets[0, :3] = -1
    return hidden, weight, targets, (torch.randn(40, dtype=dtype, requires_grad=True) if bias else None)


# ----------------------------------------------------------------------------- "auto"
def test_auto_leaves_cpu_tensors_to_ours(liger):
    hidden, weight, targets, _ = _inputs()
    loss = linear_cross_entropy(hidden, weight, targets, ignore_index=-1)
    assert liger == []  # real device check: CPU
    reference = F.cross_entropy((hidden @ weight.T).flatten(0, 1), targets.flatten(), ignore_index=-1)
    torch.testing.assert_close(loss, reference)


def test_auto_maps_every_argument_to_liger_on_cuda(liger, cuda_like):
    hidden, weight, targets, bias = _inputs(torch.bfloat16, bias=True)
    loss = linear_cross_entropy(
        hidden, weight, targets, bias=bias, ignore_index=-1, reduction="sum", label_smoothing=0.1, chunk_size=3
    )
    (call,) = liger
    assert call["input"].shape == (24, 8) and torch.equal(call["input"], hidden.reshape(24, 8))
    assert call["weight"] is weight and call["bias"] is bias and torch.equal(call["target"], targets.flatten())
    assert {k: call[k] for k in ("ignore_index", "label_smoothing", "reduction")} == {
        "ignore_index": -1,
        "label_smoothing": 0.1,
        "reduction": "sum",
    }
    assert loss.dtype == torch.float32  # the fake returns bf16, as ours: float32
    assert loss.item() == _plain(hidden.reshape(24, 8), weight, targets.flatten(), bias, -1, 0.1, "sum").float().item()
    loss.backward()  # the library's own autograd
    assert hidden.grad is not None and weight.grad is not None and bias.grad is not None


@pytest.mark.parametrize(
    "case",
    ["reduction none", "hidden without gradient", "float64", "fake tensors"],
)
def test_auto_falls_back_to_ours_for_what_liger_cannot_compute(liger, cuda_like, case):
    hidden, weight, targets, _ = _inputs(torch.float64 if case == "float64" else torch.float32)
    reduction = "none" if case == "reduction none" else "mean"
    if case == "hidden without gradient":
        hidden = hidden.detach()
    if case == "fake tensors":
        from lightning_lowmem._compat.fake_mode import fake_tensor_mode

        with fake_tensor_mode() as mode:
            fake = [mode.from_tensor(t) for t in (hidden, weight, targets)]
            loss = linear_cross_entropy(*fake, ignore_index=-1)
            named = linear_cross_entropy(*fake, ignore_index=-1, kernel="liger")  # the estimator traces ours
        assert liger == [] and loss.shape == () and named.shape == ()
        return
    loss = linear_cross_entropy(hidden, weight, targets, ignore_index=-1, reduction=reduction)
    assert liger == []
    reference = F.cross_entropy(
        (hidden @ weight.T).flatten(0, 1), targets.flatten(), ignore_index=-1, reduction=reduction
    )
    torch.testing.assert_close(loss, reference.view(loss.shape))
    if case == "hidden without gradient":  # the case liger would get wrong: no weight gradient at all
        loss.backward()
        assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_auto_tries_liger_then_cce(liger, cuda_like, monkeypatch):
    cce = _cce(monkeypatch)
    hidden, weight, targets, bias = _inputs(bias=True)
    linear_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=-1)
    assert (len(liger), len(cce)) == (1, 0)
    loss = linear_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=-1, reduction="none")
    assert (len(liger), len(cce)) == (1, 1)  # liger refuses "none": CCE computes it
    assert cce[0]["bias"] is bias and cce[0]["ignore_index"] == -1 and loss.shape == targets.shape
    flat = hidden.reshape(-1, 8)
    assert kernels.resolve_kernel("auto", flat, weight, bias=bias) == "liger"
    assert kernels.resolve_kernel("auto", flat, weight, bias=bias, reduction="none") == "cce"
    assert kernels.resolve_kernel("auto", flat, weight, reduction="none", label_smoothing=0.1) == "lowmem"
    assert kernels.resolve_kernel("lowmem", flat, weight) == "lowmem"


@pytest.mark.parametrize(
    "version, bias, smoothing, autocast, used",
    [
        ("25.6.4", True, 0.0, False, True),
        ("25.6.4", True, 0.1, False, False),  # CCE has no label smoothing
        ("25.1.1", False, 0.0, False, True),  # PyPI's release: no bias argument, none given
        ("25.1.1", False, 0.0, True, False),  # ... and autocast only from 25.6.3
        ("25.6.4", True, 0.0, True, True),
    ],
)
def test_auto_uses_cce_only_for_calls_its_release_computes(
    cuda_like, monkeypatch, version, bias, smoothing, autocast, used
):
    cce = _cce(monkeypatch, version, bias)
    hidden, weight, targets, _ = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        linear_cross_entropy(hidden, weight, targets, ignore_index=-1, label_smoothing=smoothing)
    assert len(cce) == int(used)
    if not bias:  # a bias with the old signature: ours
        linear_cross_entropy(hidden, weight, targets, bias=torch.zeros(40), ignore_index=-1)
        assert len(cce) == int(used)


# ----------------------------------------------------------------------------- explicit kernels, errors
def test_lowmem_never_dispatches(liger, cuda_like):
    hidden, weight, targets, _ = _inputs()
    linear_cross_entropy(hidden, weight, targets, ignore_index=-1, kernel="lowmem")
    assert liger == []


def test_a_missing_library_asked_for_is_one_line_naming_the_extra():
    hidden, weight, targets, _ = _inputs()
    with pytest.raises(
        ImportError, match=r"^kernel='liger' needs the liger-kernel package .*pip install 'lightning-lowmem\[liger\]'"
    ) as error:
        linear_cross_entropy(hidden, weight, targets, kernel="liger")
    assert "\n" not in str(error.value)
    with pytest.raises(ImportError, match=r"needs the cut-cross-entropy package .*'lightning-lowmem\[cce\]'"):
        linear_cross_entropy(hidden, weight, targets, kernel="cce")


def test_an_explicit_kernel_refuses_what_it_cannot_compute(liger, monkeypatch):
    hidden, weight, targets, _ = _inputs()
    with pytest.raises(
        ValueError, match=r"`kernel`='liger' cannot compute this loss: it runs on CUDA tensors only, got cpu"
    ):
        linear_cross_entropy(hidden, weight, targets, kernel="liger")
    monkeypatch.setattr(kernels, "on_cuda", lambda tensor: True)
    with pytest.raises(ValueError, match=r"reduction='none' .*Use kernel='auto' .* or 'lowmem'"):
        linear_cross_entropy(hidden, weight, targets, kernel="liger", reduction="none")
    _cce(monkeypatch)
    with pytest.raises(ValueError, match=r"`kernel`='cce' cannot compute this loss: label_smoothing=0.1"):
        linear_cross_entropy(hidden, weight, targets, kernel="cce", label_smoothing=0.1)
    assert liger == []


def test_invalid_targets_raise_before_the_kernel_runs(liger, cuda_like):
    hidden, weight, targets, _ = _inputs()
    targets[1, 2] = 40
    with pytest.raises(IndexError, match=r"class index 40, outside \[0, 40\)"):
        linear_cross_entropy(hidden, weight, targets, ignore_index=-1)
    assert liger == []


@pytest.mark.parametrize("kernel", ["ligr", None, "Liger"])
def test_unknown_kernel(kernel):
    hidden, weight, targets, _ = _inputs()
    with pytest.raises(ValueError, match=r"`kernel`=.* is unknown; choose one of \['auto', 'lowmem', 'liger', 'cce'\]"):
        linear_cross_entropy(hidden, weight, targets, kernel=kernel)
    with pytest.raises(ValueError, match=r"`kernel`=.* is unknown"):
        CrossEntropyConfig(kernel=kernel)


# ----------------------------------------------------------------------------- tied weights
class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.body = nn.Embedding(40, 8), nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 40, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.body(self.embed(ids))))


@pytest.mark.parametrize("kernel, dispatched", [("auto", False), ("liger", True)])
def test_tied_weight_auto_keeps_ours_and_liger_bypasses_the_shared_buffer(liger, cuda_like, kernel, dispatched):
    """ "auto" keeps ours (one gradient buffer for both uses); "liger" returns its own weight gradient, the tied
    embedding's backward then makes its own: autograd sums them, the gradient is still the unchunked one."""
    torch.manual_seed(0)
    reference, model = TiedLM(), TiedLM()
    model.load_state_dict(reference.state_dict())
    report = chunk_cross_entropy_(model, kernel=kernel)
    assert report.tied_embeddings == ["embed"] and report.kernel == kernel
    ids, targets = torch.randint(40, (3, 10)), torch.randint(40, (3, 10))
    F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten()).backward()
    chunked_cross_entropy(model(ids), targets).backward()
    assert len(liger) == int(dispatched)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7, msg=name)
    report.undo()


def test_chunked_cross_entropy_takes_the_kernel_of_its_deferred_logits(liger, cuda_like):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.lm_head = nn.Linear(8, 40)
    report = chunk_cross_entropy_(model, kernel="lowmem")
    hidden, targets = torch.randn(2, 5, 8, requires_grad=True), torch.randint(40, (2, 5))
    logits = model.lm_head(hidden)
    assert logits[:, :-1].kernel == "lowmem"  # indexing keeps it
    chunked_cross_entropy(logits, targets)
    assert liger == []
    chunked_cross_entropy(logits, targets, kernel="liger")  # the call's own choice wins
    assert len(liger) == 1
    report.undo()
    with pytest.raises(ValueError, match=r"`kernel`='cuda' is unknown"):
        chunk_cross_entropy_(model, kernel="cuda")
