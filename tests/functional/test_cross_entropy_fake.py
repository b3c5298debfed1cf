"""linear_cross_entropy on fake tensors (estimate_memory) runs its first two and last vocabulary slices only: the same
peak, breakdown and phases as every slice run."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem.functional.cross_entropy import fused, half, linear
from lightning_lowmem.planning.estimate import TrainingConfig, estimate_memory

transformers = pytest.importorskip("transformers")


def _llama_and_batch():
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=3001
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 3001, (2, 256))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _assert_same_figures(fast, every):
    assert fast.peak_bytes == every.peak_bytes
    assert {k: v["peak_bytes"] for k, v in fast.phases.items()} == {k: v["peak_bytes"] for k, v in every.phases.items()}
    # the peak's split by category too (it once differed by 4 KiB inside the full suite: the tracker relabelled a
    # storage that took a freed forward allocation's address; it now relabels only what forward made)
    assert fast.breakdown == every.breakdown


def _runs_shortcut_and_everything(monkeypatch, model, batch, mix, starts):
    """``(the most starts one loop ran, the estimate as the shortcuts run, the estimate with every chunk run)``;
    ``starts``: ``(module, name)`` of each loop-start function, all of one signature ``(total, step, tensor)``."""
    runs: list[int] = []
    real = getattr(*starts[0])

    def counted(total, step, tensor):
        found = real(total, step, tensor)
        runs.append(len(found))
        return found

    for module, name in starts:
        monkeypatch.setattr(module, name, counted)
    fast = estimate_memory(model, batch, device="cuda", config=mix)
    for module, name in starts:
        monkeypatch.setattr(module, name, lambda total, step, tensor: list(range(0, total, step)))
    every = estimate_memory(model, batch, device="cuda", config=mix)
    return max(runs, default=0), fast, every


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_two_slices_on_fake_tensors_estimate_what_all_slices_do(monkeypatch, precision):
    model, batch = _llama_and_batch()
    # a full fine-tune: the head's weight gradient is made a vocabulary slice at a time in every precision (with a
    # frozen head, bf16's one-pass forward leaves backward no vocabulary loop)
    mix = TrainingConfig(precision=precision, cross_entropy={"mode": "chunked", "chunk_size": 48})
    # bf16-true: half's token chunks, work blocks and slices too
    most, fast, every = _runs_shortcut_and_everything(
        monkeypatch, model, batch, mix, [(linear, "_slice_starts"), (half, "chunk_starts")]
    )
    assert most == 3  # the first two and the last only (of 11 slices: 3001 classes, 48 of 512 tokens a slice)
    _assert_same_figures(fast, every)


def test_real_tensors_run_every_slice():
    assert linear._slice_starts(13, 3, torch.zeros(1)) == [0, 3, 6, 9, 12]


@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_first_two_and_last_token_chunks_on_fake_tensors_estimate_what_all_chunks_do(monkeypatch, precision):
    # a frozen head (LoRA): the one-pass paths walk the tokens in chunks (bf16: matmul chunks of fp32 softmax chunks)
    model, batch = _llama_and_batch()
    mix = TrainingConfig(precision=precision, cross_entropy={"mode": "chunked", "chunk_size": 16}, lora={"r": 4})
    most, fast, every = _runs_shortcut_and_everything(
        monkeypatch, model, batch, mix, [(fused, "chunk_starts"), (half, "chunk_starts")]
    )
    assert most == 3  # 512 tokens, 16 at a time: 3 of 32 chunks
    _assert_same_figures(fast, every)
