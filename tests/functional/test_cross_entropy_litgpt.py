"""The LitGPT recipe of docs/llm_memory.md: LitGPT's `GPT` under chunk_cross_entropy_ with the one-line loss change
gives the unchunked gradients. litgpt pins huggingface-hub below what transformers 5 needs: this runs where it
installs (the transformers-4 leg of `make test-compat`), and is skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

litgpt_model = pytest.importorskip("litgpt.model")
litgpt_config = pytest.importorskip("litgpt.config")

from lightning_lowmem.functional.cross_entropy import (  # noqa: E402
    DeferredLogits,
    LogitsNotComputedError,
    chunk_cross_entropy_,
    chunked_cross_entropy,
)


def _gradients(model, idx):
    model.zero_grad()
    logits = model(idx)
    chunked_cross_entropy(logits[:, :-1], idx[:, 1:], chunk_size=16).backward()
    return logits, [p.grad.clone() for p in model.parameters()]


def _config(name: str):
    if name == "pythia-14m":  # the real vocabulary (50,304): where chunking matters
        return litgpt_config.Config.from_name("pythia-14m", n_layer=2)
    from tests.litgpt_zoo import litgpt_config as zoo_config  # the zoo's Llama: RMSNorm, GQA, LLaMAMLP

    return zoo_config("llama")


@pytest.mark.parametrize("name", ["pythia-14m", "zoo-llama"])
def test_litgpt_gpt_recipe_gives_the_unchunked_gradients(name):
    torch.manual_seed(0)
    config = _config(name)
    model = litgpt_model.GPT(config)
    idx = torch.randint(config.padded_vocab_size, (2, 32))
    _, reference = _gradients(model, idx)
    handle = chunk_cross_entropy_(model)
    assert handle.heads == ["lm_head"]
    logits, chunked = _gradients(model, idx)
    assert isinstance(logits, DeferredLogits) and logits.shape == (2, 32, config.padded_vocab_size)
    for ours, theirs in zip(chunked, reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    with pytest.raises(LogitsNotComputedError):
        logits.argmax(-1)
    handle.undo()
    assert isinstance(model(idx), torch.Tensor)
