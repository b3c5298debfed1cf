"""estimate_memory against the CUDA caching allocator (``torch.cuda.max_memory_allocated``): allocator
rounding and the cuBLAS workspace included, on charlm and a Hugging Face GPT-2, for the technique mixes
the estimate claims to cover. GPU only (``cuda`` marker)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils._pytree import tree_map

from lightning_lowmem.demo import CharLM
from lightning_lowmem.functional.optimizers.catalog import build_optimizer
from lightning_lowmem.planning.estimate import (
    TrainingConfig,
    _apply_model_techniques,
    _train_step,
    default_loss,
    estimate_memory,
)

pytestmark = pytest.mark.cuda

CONFIGS = {
    "fp32": TrainingConfig(),
    "bf16-true": TrainingConfig(precision="bf16-true"),
    "checkpointing": TrainingConfig(activation_checkpointing="auto"),
    "int8-compression": TrainingConfig(activation_compression="int8"),
    "adamw8bit": TrainingConfig(optimizer="adamw8bit"),
}


def _charlm(batch_size: int = 8):
    torch.manual_seed(0)
    x = torch.randint(0, 256, (batch_size, 128))
    return CharLM(n_layer=4, n_head=4, n_embd=256, block_size=128), (x, x.roll(-1, 1))


def _gpt2(batch_size: int = 8):
    pytest.importorskip("transformers")
    from lightning_lowmem.models.hf import HFLanguageModel

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (batch_size, 128))
    model = HFLanguageModel("gpt2", config={"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 128})
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _allocator_peak(model, batch, config: TrainingConfig) -> int:
    """``max_memory_allocated`` of the second real step (the first creates the optimizer state), from a
    clean slate: no cuBLAS workspace, earlier tests' leftovers subtracted."""
    gc.collect()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # the estimate counts the workspace
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    leftover = torch.cuda.memory_allocated()  # tensors an earlier test left alive (constant during the step)
    dtype = torch.bfloat16 if config.precision_preset == "bf16-true" else None
    model = model.cuda().to(dtype) if dtype else model.cuda()
    batch = tree_map(lambda t: t.cuda().to(dtype) if dtype and t.is_floating_point() else t.cuda(), batch)
    _apply_model_techniques(model, config)
    optimizer = build_optimizer(config.optimizer.name, [p for p in model.parameters() if p.requires_grad])
    _train_step(model, batch, default_loss, optimizer, config, None)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _train_step(model, batch, default_loss, optimizer, config, None)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - leftover


def _predicted(model, batch, config: TrainingConfig) -> int:
    report = estimate_memory(model, batch, device="cuda", config=config)
    return report.peak_bytes + report.overheads["cublas_workspace"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_charlm_estimate_within_10_percent_of_the_allocator(name):
    config = CONFIGS[name]
    model, batch = _charlm()
    predicted = _predicted(model, batch, config)
    measured = _allocator_peak(model, batch, config)
    assert predicted == pytest.approx(measured, rel=0.10), (
        f"{name}: estimated {predicted:,} B, allocator {measured:,} B"
    )


@pytest.mark.parametrize("name", ["fp32", "bf16-true"])
def test_hf_gpt2_estimate_within_10_percent_of_the_allocator(name):
    config = CONFIGS[name]
    model, batch = _gpt2()
    predicted = _predicted(model, batch, config)
    measured = _allocator_peak(model, batch, config)
    assert predicted == pytest.approx(measured, rel=0.10), (
        f"{name}: estimated {predicted:,} B, allocator {measured:,} B"
    )


def _hf_long(family: str, length: int, **overrides):
    """A 2 x 128, 8-head Hugging Face model and an unpadded batch of 2 x ``length`` tokens (#29's rows)."""
    pytest.importorskip("transformers")
    from lightning_lowmem.models.hf import HFLanguageModel

    torch.manual_seed(0)
    if family == "gpt2":
        config = {"n_embd": 128, "n_layer": 2, "n_head": 8, "n_positions": length, **overrides}
    else:
        config = {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "max_position_embeddings": length,
            **overrides,
        }
    ids = torch.randint(0, 256, (2, length))
    return HFLanguageModel(family, config=config), {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.clone(),
    }


@pytest.mark.parametrize(
    ("family", "length", "name", "overrides", "kernel"),
    [
        ("gpt2", 2048, "fp32", {"attn_pdrop": 0.1}, "efficient"),  # CPU runs math here (dropout): 1.9 GiB
        ("llama", 2048, "fp32", {}, "efficient"),
        ("llama", 8192, "fp32", {}, "efficient"),
        ("llama", 8192, "bf16-true", {}, "flash"),
    ],
)
def test_long_context_estimate_within_10_percent_of_the_allocator(family, length, name, overrides, kernel):
    """The fake step runs the attention kernel CUDA picks and keeps what it keeps (planning/attention_kernels.py)."""
    config = CONFIGS[name].replace(optimizer="adamw")
    model, batch = _hf_long(family, length, **overrides)
    report = estimate_memory(model, batch, device="cuda", config=config)
    assert report.meta["attention_kernels"] == {kernel: 2}
    predicted = report.peak_bytes + report.overheads["cublas_workspace"]
    measured = _allocator_peak(model, batch, config)
    assert predicted == pytest.approx(measured, rel=0.10), f"estimated {predicted:,} B, allocator {measured:,} B"
