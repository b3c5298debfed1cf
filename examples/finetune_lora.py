"""Fine-tune a pretrained charlm on a new part of the stdlib: full fine-tuning vs LoRA vs QLoRA.

    python examples/finetune_lora.py                       # all three methods, small settings
    python examples/finetune_lora.py --methods lora --finetune-steps 300

1. Pretrain a character-level GPT on stdlib files outside ``asyncio/`` (or reuse ``--base`` weights).
2. Fine-tune it on ``asyncio/*`` with each method for the same number of steps and print the
   validation loss, the trainable parameter count and the training step's model state (memory core).
3. LoRA runs save adapters only; ``load_adapters`` puts them into a fresh copy of the base model.

The measured comparison (more steps) is ``python -m benchmarks --only lora``: benchmarks/results/lora.md.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import lightning as L
import torch

from lightning_lowmem.callbacks.low_rank_adapters import LowRankAdapters
from lightning_lowmem.demo import CharLM, CharLMDataModule
from lightning_lowmem.functional.lora.files import load_adapters
from lightning_lowmem.memory import format_bytes, state_bytes

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*Enum subclass.*")
MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=64)
METHODS = {  # name -> (learning rate, LowRankAdapters arguments or None for full fine-tuning)
    "full": (1e-3, None),
    "lora": (6e-3, dict(r=8, alpha=16)),
    "qlora": (6e-3, dict(r=8, alpha=16, quantize_base="int8")),
}


def trainer(out: Path, steps: int, callbacks: list[L.Callback] | None = None) -> L.Trainer:
    return L.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps,
        limit_val_batches=20,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        callbacks=callbacks,
    )


def pretrain(out: Path, steps: int) -> Path:
    L.seed_everything(0)
    model = CharLM(**MODEL, lr=3e-3)
    trainer(out / "pretrain", steps).fit(model, CharLMDataModule(exclude=["asyncio/*"], max_chars=600_000))
    path = out / "pretrained.pt"
    torch.save(model.state_dict(), path)
    return path


def finetune(method: str, base: Path, out: Path, steps: int) -> None:
    lr, lora = METHODS[method]
    L.seed_everything(0)
    model = CharLM(**MODEL, lr=lr)
    data = CharLMDataModule(include=["asyncio/*"], max_chars=400_000)
    # full fine-tuning loads the base here; LowRankAdapters can do it itself (handy in YAML configs)
    callbacks = [LowRankAdapters(**lora, base_weights_path=str(base))] if lora else []
    if lora is None:
        model.load_state_dict(torch.load(base, weights_only=True))
    fit = trainer(out / method, steps, callbacks)
    fit.fit(model, data)
    val_loss = fit.validate(model, data, verbose=False)[0]["val_loss"]
    held = state_bytes(model, fit.optimizers)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        f"{method:>5}: asyncio val loss {val_loss:.4f} | trainable {trainable:,} | params "
        f"{format_bytes(held['parameters'])}, grads+optimizer {format_bytes(held['gradients'] + held['optimizer_state'])}"
    )
    if lora is not None:  # adapters-only checkpoint -> fresh base model
        ckpt = out / f"{method}.ckpt"
        fit.save_checkpoint(ckpt)
        fresh = CharLM(**MODEL)
        fresh.load_state_dict(torch.load(base, weights_only=True))
        load_adapters(fresh, ckpt)
        print(f"       checkpoint {format_bytes(ckpt.stat().st_size)}; reloaded into a fresh base model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("lora_example"))
    parser.add_argument("--base", type=Path, default=None, help="pretrained CharLM state dict (skips pretraining)")
    parser.add_argument("--pretrain-steps", type=int, default=200)
    parser.add_argument("--finetune-steps", type=int, default=100)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.base or pretrain(args.out, args.pretrain_steps)
    for method in args.methods:
        finetune(method, base, args.out, args.finetune_steps)


if __name__ == "__main__":
    main()
