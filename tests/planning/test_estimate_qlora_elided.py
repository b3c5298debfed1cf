"""The NF4 QLoRA estimate skips the slabs that repeat (``elide_repeated_slabs``) and every figure stays the byte it
was when each slab ran: the peak, the breakdown, the phases, the "other" kinds and the card's allocator figures, on
Hugging Face Llama and BERT, with and without ``quantize_frozen``, and on a layer decoded whole (``_nf4_dense``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.lora import quantized_base
from lightning_lowmem.planning.estimate import estimate_memory

hf_zoo = pytest.importorskip("tests.hf_zoo", reason="needs transformers")

# hidden 512: a slab is 128 rows (4 per q_proj), the 1376-wide MLP ends on a shorter slab, the 8000-row head 63
SHAPES = {
    "llama": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=2, num_attention_heads=8),
    "bert": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=2, num_attention_heads=8),
}


def _estimate(model: nn.Module, batch, elide: bool, monkeypatch, **kwargs) -> tuple[dict, int]:
    """The report as a dict, and how many slabs ran (``_dense_slab`` / ``_nf4_dense`` parts)."""
    monkeypatch.setattr(quantized_base, "FAKE_SHORTCUTS", elide)
    calls = {"slabs": 0}
    dense_slab = quantized_base._dense_slab

    def counted(*args, **kw):
        calls["slabs"] += 1
        return dense_slab(*args, **kw)

    monkeypatch.setattr(quantized_base, "_dense_slab", counted)
    report = estimate_memory(model, batch, **kwargs)
    figures = report.to_dict()
    return figures, calls["slabs"]


@pytest.mark.parametrize("family", ["llama", "bert"])
@pytest.mark.parametrize("quantize_frozen", [True, False])
def test_elided_slabs_change_no_byte(family, quantize_frozen, monkeypatch):
    model = hf_zoo.hf_module(family, **SHAPES[family])
    batch = hf_zoo.hf_batch(family, seq_len=64, batch_size=2)
    lora = dict(r=8, quantize_base="nf4", quantize_frozen=quantize_frozen)
    if not quantize_frozen:
        lora["target"] = ["q_proj", "v_proj", "down_proj"] if family == "llama" else ["query", "value", "output.dense"]
    kwargs = dict(lora=lora, precision="bf16-true", gpu="A10G", activation_checkpointing="auto")
    slow, slow_slabs = _estimate(model, batch, False, monkeypatch, **kwargs)
    fast, fast_slabs = _estimate(model, batch, True, monkeypatch, **kwargs)
    assert fast == slow  # every figure: peak, breakdown, phases, other kinds, allocated / reserved on the card
    assert slow["peak_bytes"] > 0 and slow["meta"]["gpu"]["reserved_bytes"] > 0
    assert fast_slabs < slow_slabs, (fast_slabs, slow_slabs)  # skipped (few here: 4 to 11 slabs a layer)


def test_a_layer_decoded_whole_elides_its_parts_exactly(monkeypatch):
    """in_features 96 is no multiple of NF4's 64-weight block: the layer is dequantized whole, in 64k-weight parts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 96), nn.Linear(96, 4096), nn.GELU(), nn.Linear(4096, 8))
    calls = {"parts": 0}
    nf4_dense = quantized_base._nf4_dense

    def counted(*args, **kw):
        calls["parts"] += 1
        return nf4_dense(*args, **kw)

    monkeypatch.setattr(quantized_base, "_nf4_dense", counted)
    batch = torch.randn(4, 96)
    figures = []
    for elide in (False, True):
        monkeypatch.setattr(quantized_base, "FAKE_SHORTCUTS", elide)
        report = estimate_memory(
            model,
            batch,
            loss_fn=lambda m, x: m(x).square().mean(),
            lora=dict(r=4, target=["0"], quantize_base="nf4", quantize_frozen=True),
            gpu="A10G",
        )
        figures.append(report.to_dict())
    assert calls["parts"] > 0  # the whole-layer path ran
    assert figures[0] == figures[1] and figures[0]["peak_bytes"] > 0


def test_real_tensors_run_every_slab():
    """Outside a fake step (a real forward) nothing is skipped, even inside ``elide_repeated_slabs``."""
    torch.manual_seed(0)
    layer = nn.Linear(512, 1024)
    x = torch.randn(3, 512)
    layer.weight = quantized_base.to_nf4_parameter(layer.weight)
    want = torch.nn.functional.linear(x, quantized_base.dequantized(layer.weight), layer.bias)
    with quantized_base.elide_repeated_slabs(lambda: 0):  # a state that never changes
        got = quantized_base.frozen_linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(got, want)  # 8 slabs of 128 rows: a skipped one would leave its rows unwritten


@pytest.mark.parametrize(
    ("shape", "dtype"), [((1024, 512), torch.bfloat16), ((64, 96), torch.float32), ((8000, 512), torch.float16)]
)
def test_the_fake_nf4_layout_is_to_nf4s(shape, dtype, monkeypatch):
    """Shapes, strides, dtypes, storage sizes and the metadata of each inner tensor, as torchao's ``to_nf4`` makes
    them on the same fake weight."""
    from lightning_lowmem._compat.fake_mode import fake_tensor_mode

    def layout(shortcut: bool) -> list:
        monkeypatch.setattr(quantized_base, "FAKE_SHORTCUTS", shortcut)
        with fake_tensor_mode():
            nf4 = quantized_base.to_nf4_parameter(torch.empty(shape, dtype=dtype))
            names, context = nf4.__tensor_flatten__()
            inner = [getattr(nf4, name) for name in names]
            storages = {id(t.untyped_storage()) for t in inner}
            described = [
                (t.shape, t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().nbytes(), t.requires_grad)
                for t in inner
            ]
            return [type(nf4), nf4.shape, nf4.dtype, nf4.requires_grad, names, context, len(storages), described]

    assert layout(True) == layout(False)
