"""Train the charlm GPT briefly, quantize it to int8 (Linear layers and embedding tables) within a
val-loss tolerance, save a checkpoint, and get the quantized model back the three supported ways.

Run: ``python examples/quantize_charlm.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import os
import tempfile
import warnings

import lightning as L
import torch

from lightning_lowmem.callbacks.post_training_quantization import (
    PostTrainingQuantization,
    load_quantized_checkpoint,
    quantize_like_checkpoint,
)
from lightning_lowmem.demo import CharLM, CharLMDataModule

warnings.filterwarnings("ignore", module="torchao")


class QuantizedCharLM(CharLM):
    """``load_from_checkpoint`` returns the quantized model: quantize before Lightning loads the weights."""

    def on_load_checkpoint(self, checkpoint):
        quantize_like_checkpoint(self, checkpoint)


def main() -> None:
    L.seed_everything(0)
    model = QuantizedCharLM(n_layer=2, n_head=4, n_embd=128, block_size=64, lr=3e-3)
    data = CharLMDataModule(block_size=64, batch_size=32, max_chars=1_000_000)
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    # 1. int8 at fit end; layers fall back to float while val_loss rises by more than 0.02
    ptq = PostTrainingQuantization("int8_dynamic", monitor="val_loss", monitor_mode="min", tolerance=0.02)
    trainer = L.Trainer(max_steps=300, val_check_interval=100, limit_val_batches=20, callbacks=[ptq], **quiet)
    trainer.fit(model, data)
    before, after = ptq.summary["before"], ptq.summary["after"]
    print(
        f"int8: {before['bytes'] / after['bytes']:.2f}x smaller, val_loss {before['metric']:.4f} -> "
        f"{after['metric']:.4f}, kept float: {ptq.summary['kept_float'] or 'none'}"
    )
    path = os.path.join(tempfile.mkdtemp(), "charlm_int8.ckpt")
    trainer.save_checkpoint(path)
    tokens = next(iter(data.val_dataloader()))[0][:4]
    with torch.no_grad():
        expected = model.eval()(tokens)
    # 2. back from the checkpoint: a Trainer with the same callback, load_from_checkpoint, or one call
    fresh = CharLM(n_layer=2, n_head=4, n_embd=128, block_size=64)
    checker = L.Trainer(callbacks=[PostTrainingQuantization("int8_dynamic")], **quiet)  # whole val set, as PTQ
    val_loss = checker.validate(fresh, data, ckpt_path=path, verbose=False)[0]["val_loss"]
    loaded = QuantizedCharLM.load_from_checkpoint(path, map_location="cpu", weights_only=True)
    rebuilt = load_quantized_checkpoint(CharLM, path, weights_only=True)
    with torch.no_grad():
        same = all(torch.equal(m.eval()(tokens), expected) for m in (fresh, loaded, rebuilt))
    print(
        f"reloaded 3 ways: weights {type(loaded.model.lm_head.weight).__name__}, same outputs: {same}, "
        f"val_loss via ckpt_path {val_loss:.4f}"
    )


if __name__ == "__main__":
    main()
