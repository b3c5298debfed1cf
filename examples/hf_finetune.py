"""Fine-tune a Hugging Face causal LM in little memory, then ship it in int8.

    python examples/hf_finetune.py                               # a tiny GPT-2 built from a config (no download)
    python examples/hf_finetune.py --family llama --steps 200
    python examples/hf_finetune.py --pretrained ./my-gpt2        # a local `save_pretrained` directory + its tokenizer

The model is wrapped the way users wrap ``transformers`` models (:class:`lightning_lowmem.demo.HFLanguageModel`:
dict batches, ``self.model(**batch).loss``) and trained with the lowmem stack, all as callbacks:

* ``LowRankAdapters(r=8)``: LoRA adapters on every linear / ``Conv1D`` layer; the base is frozen;
* ``ActivationCheckpointing("auto")``: the transformer blocks are recomputed in backward (``use_cache`` is
  switched off while training and restored after);
* ``ActivationCompression("int8")``: what backward still needs is kept as int8;
* ``MemoryEfficientOptimizer(...)``: 8-bit AdamW on a GPU; on a CPU the default is Adafactor, because torchao
  compiles its 8-bit step per tensor shape on the first step there (minutes on 2 cores);
* ``MemoryMonitor()``: the measured breakdown of a training step.

Then the adapters are merged into the base weights of a plain model and ``quantize_(model, "int8_dynamic")``
stores its weights (and the tied embeddings) in int8. The same run from YAML: ``lowmem fit --config examples/configs/hf_finetune.yaml``.
"""

from __future__ import annotations

import argparse
import warnings

import lightning as L
import torch

from lightning_lowmem import (
    ActivationCheckpointing,
    ActivationCompression,
    LowRankAdapters,
    MemoryEfficientOptimizer,
    MemoryMonitor,
)
from lightning_lowmem.demo import HFLanguageModel, HFTextDataModule
from lightning_lowmem.models.hf import FAMILIES
from lightning_lowmem.memory import format_bytes, state_bytes

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="gpt2", choices=[f for f, task in FAMILIES.items() if task == "causal"])
    parser.add_argument("--pretrained", default=None, help="a local directory saved with `save_pretrained`")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--optimizer", default=None, help="default: adamw8bit on CUDA, adafactor on CPU")
    parser.add_argument("--lr", type=float, default=5e-3)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (MemoryMonitor measures the second step), got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    L.seed_everything(0)
    optimizer = args.optimizer or ("adamw8bit" if torch.cuda.is_available() else "adafactor")
    config = (
        None
        if args.pretrained
        else {"n_layer": 4, "n_embd": 128}
        if args.family == "gpt2"
        else {"num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 256}
    )
    model = HFLanguageModel(args.family, pretrained=args.pretrained, config=config)
    data = HFTextDataModule("causal", seq_len=args.seq_len, batch_size=args.batch_size, tokenizer=args.pretrained)
    monitor = MemoryMonitor(summary=False)
    adapters = LowRankAdapters(r=8, alpha=16)
    trainer = L.Trainer(
        max_steps=args.steps,
        limit_val_batches=10,
        val_check_interval=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[
            adapters,
            ActivationCheckpointing("auto"),
            ActivationCompression("int8"),
            MemoryEfficientOptimizer(optimizer, lr=args.lr),
            monitor,
        ],
    )
    before = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    trainer.fit(model, data)
    after = trainer.callback_metrics["val_loss"].item()
    report = monitor.last_report
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{type(model.model).__name__}: val_loss {before:.3f} -> {after:.3f} after {args.steps} steps")
    print(
        f"training step peak {format_bytes(report.peak_bytes)} "
        f"(activations {format_bytes(report.breakdown['activations'])}), trainable parameters {trainable:,}"
    )

    from lightning_lowmem.functional.lora.adapters import merged_state_dict
    from lightning_lowmem.functional.quantization.ptq import quantize_

    # ship: the adapters folded into the base weights of a plain model, stored in int8
    shipped = HFLanguageModel(args.family, pretrained=args.pretrained, config=config)
    shipped.load_state_dict(merged_state_dict(model))
    float_bytes = state_bytes(shipped)["parameters"]
    report = quantize_(shipped, "int8_dynamic")
    int8_bytes = state_bytes(shipped)["parameters"]
    plain = L.Trainer(limit_val_batches=10, logger=False, enable_checkpointing=False, enable_model_summary=False)
    quantized = plain.validate(shipped, data, verbose=False)[0]["val_loss"]  # no training callbacks: a shipped model
    print(
        f"int8: {len(report.converted)} layers, {format_bytes(float_bytes)} -> {format_bytes(int8_bytes)} "
        f"({float_bytes / int8_bytes:.2f}x smaller), val_loss {quantized:.3f}"
    )
    return {
        "val_loss_before": before,
        "val_loss_after": after,
        "val_loss_int8": quantized,
        "size_ratio": float_bytes / int8_bytes,
        "peak_bytes": float(monitor.last_report.peak_bytes),
    }


if __name__ == "__main__":
    main()
