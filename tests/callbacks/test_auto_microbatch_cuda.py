"""AutoMicrobatch after a *real* CUDA out-of-memory error: the process is capped with
``torch.cuda.set_per_process_memory_fraction`` so that whole batches cannot fit; training completes in
micro-batches with the weights an accumulation run reaches. GPU only (``cuda`` marker)."""

from __future__ import annotations

import copy
import gc

import lightning as L
import pytest
import torch
from torch import nn

from lightning_lowmem.callbacks.auto_microbatch import AutoMicrobatch

pytestmark = pytest.mark.cuda
BATCH, TOKENS, WIDTH, HIDDEN = 32, 512, 256, 4096  # activations ~16 MiB a sample; weights ~8 MiB


class _TokenMLP(L.LightningModule):
    """Two-layer MLP over (B, TOKENS, WIDTH): activations, not weights, decide its memory."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader(batch_size: int) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4 * BATCH, TOKENS, WIDTH, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.flip(-1)), batch_size=batch_size)


def _reserved(model: _TokenMLP, micro: int) -> int:
    """Bytes the caching allocator reserves for a training step (second: AdamW state exists) in micro-batches."""
    model = copy.deepcopy(model).cuda()
    optimizer = model.configure_optimizers()
    x, y = (t.cuda() for t in next(iter(_loader(BATCH))))
    for step in range(2):
        if step == 1:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for start in range(0, BATCH, micro):
            (model.training_step((x[start : start + micro], y[start : start + micro]), 0) * micro / BATCH).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    reserved = torch.cuda.max_memory_reserved()
    del model, optimizer, x, y
    gc.collect()
    torch.cuda.empty_cache()
    return reserved


def _fit(model: L.LightningModule, batch_size: int, tmp_path, callbacks=(), **kwargs) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=list(callbacks),
        **kwargs,
    )
    trainer.fit(model, _loader(batch_size))
    model.cpu()
    gc.collect()
    torch.cuda.empty_cache()
    return trainer


def test_auto_microbatch_survives_a_real_cuda_oom_with_accumulation_weights(tmp_path):
    base = _TokenMLP()
    eighth, quarter, half, whole = (_reserved(base, micro) for micro in (4, 8, 16, 32))
    assert eighth < quarter < half < whole  # activations decide the reservation
    cap = (quarter + half) // 2  # micro-batches of 16 do not fit, micro-batches of 8 do
    fraction = (torch.cuda.memory_reserved() + cap) / torch.cuda.get_device_properties(0).total_memory
    auto_model, accumulate_model = copy.deepcopy(base), copy.deepcopy(base)
    callback = AutoMicrobatch()
    torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        trainer = _fit(auto_model, BATCH, tmp_path / "auto", [callback])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert trainer.global_step == 3
    assert callback.micro_batch_size is not None and callback.micro_batch_size <= BATCH // 4, callback.micro_batch_size
    micro = callback.micro_batch_size
    _fit(accumulate_model, micro, tmp_path / "accumulate", accumulate_grad_batches=BATCH // micro)
    diff = max(
        (a - b).abs().max().item() for a, b in zip(auto_model.parameters(), accumulate_model.parameters(), strict=True)
    )
    assert diff <= 1e-6, diff
