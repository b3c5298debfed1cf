"""Distil a big teacher into a small student, on `digits` (MLPs), `charlm` (character GPTs) and Hugging Face GPT-2.

    python examples/distill_digits.py                    # digits: 2x512 teacher -> 2x240 student
    python examples/distill_digits.py --workload charlm  # charlm: 4-layer GPT -> 2-layer GPT
    python examples/distill_digits.py --workload gpt2    # transformers GPT-2 (4x128) -> GPT-2 (2x64), dict batches
    python examples/distill_digits.py --quick            # a smoke run (few steps)

Each run trains the teacher first (a normal Lightning fit, checkpointed), then a DistillationModule whose
teacher is rebuilt from that checkpoint — the same flow as the YAML config
(`examples/configs/distillation.yaml` with `teacher_checkpoint:`).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning as L
import torch

from lightning_lowmem.demo.charlm import CharLM, CharLMDataModule
from lightning_lowmem.demo.digits import DigitsClassifier, DigitsDataModule, digits_mlp
from lightning_lowmem.distillation import DistillationModule


def trainer(steps: int, root: Path, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        limit_val_batches=20,
        **kwargs,
    )


def digits(steps: int, root: Path) -> None:
    data = DigitsDataModule(batch_size=64)
    teacher = DigitsClassifier(hidden=512, depth=2)
    fit = trainer(steps, root / "teacher")
    fit.fit(teacher, data)
    checkpoint = root / "teacher.ckpt"
    fit.save_checkpoint(checkpoint)

    module = DistillationModule(
        student=digits_mlp(240, 2),  # ~1/4 of the teacher's parameters
        teacher=DigitsClassifier(hidden=512, depth=2),  # rebuilt from the checkpoint, never saved again
        teacher_checkpoint=str(checkpoint),
        temperature=4.0,
        alpha=0.9,
        teacher_precision="bf16",  # half the teacher's memory
        lr=3e-3,  # a student trained from scratch (the default 5e-5 is for a pretrained one)
    )
    distil = trainer(steps // 2, root / "student")
    distil.fit(module, data)
    print({k: round(float(v), 4) for k, v in distil.callback_metrics.items()})


def charlm(steps: int, root: Path) -> None:
    data = CharLMDataModule(block_size=64, batch_size=16, max_chars=300_000)
    teacher = CharLM(n_layer=4, n_head=4, n_embd=128)
    fit = trainer(steps, root / "teacher")
    fit.fit(teacher, data)
    checkpoint = root / "teacher.ckpt"
    fit.save_checkpoint(checkpoint)

    module = DistillationModule(
        student=CharLM(n_layer=2, n_head=2, n_embd=64),  # logits (B, T, 256), like the teacher's
        teacher=CharLM(n_layer=4, n_head=4, n_embd=128),
        teacher_checkpoint=str(checkpoint),
        temperature=2.0,
        alpha=0.5,
        hint_layers={"model.ln_f": "model.ln_f"},  # FitNets hint: a learned 64 -> 128 adapter
        lr=3e-3,  # from scratch
    )
    distil = trainer(steps, root / "student")
    distil.fit(module, data)
    print({k: round(float(v), 4) for k, v in distil.callback_metrics.items()})


def gpt2(steps: int, root: Path) -> None:
    """Token-level KD between two randomly initialised `transformers` GPT-2s over dict batches (input_ids,
    attention_mask, labels; ragged right padding). Nothing to override: both models are called `model(**batch)`,
    the KD term reads `.logits` on the positions that are neither padding nor `labels == -100`, the hard term is
    the student's own (shifted) `.loss`."""
    from lightning_lowmem.models.hf import HFLanguageModel, HFTextDataModule

    data = HFTextDataModule("causal", seq_len=64, batch_size=16, max_chars=300_000)
    teacher = HFLanguageModel("gpt2", config={"n_layer": 4, "n_embd": 128}, lr=3e-3)
    fit = trainer(steps, root / "teacher")
    fit.fit(teacher, data)
    checkpoint = root / "teacher.ckpt"
    fit.save_checkpoint(checkpoint)

    module = DistillationModule(
        student=HFLanguageModel("gpt2", config={"n_layer": 2, "n_embd": 64}),  # ~1/6 of the teacher's parameters
        teacher=HFLanguageModel("gpt2", config={"n_layer": 4, "n_embd": 128}),  # rebuilt from the checkpoint
        teacher_checkpoint=str(checkpoint),
        temperature=2.0,
        alpha=0.5,
        teacher_precision="int8",  # GPT-2's Conv1D layers are quantized too
        lr=3e-3,  # from scratch
    )
    distil = trainer(steps, root / "student")
    distil.fit(module, data)
    print({k: round(float(v), 4) for k, v in distil.callback_metrics.items()})  # val_loss, teacher_val_loss, ...


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["digits", "charlm", "gpt2"], default="digits")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    steps = 20 if args.quick else (600 if args.workload == "digits" else 300)
    with tempfile.TemporaryDirectory() as root:
        {"digits": digits, "charlm": charlm, "gpt2": gpt2}[args.workload](steps, Path(root))


if __name__ == "__main__":
    main()
