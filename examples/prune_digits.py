"""Prune a digits classifier while it trains, then ship it small.

    python examples/prune_digits.py                 # MLP to 90% sparsity (cubic), sparse export
    python examples/prune_digits.py --structural    # CNN: remove 50% of the conv channels, then fine-tune
    python examples/prune_digits.py --quick         # a smoke run (few epochs)

The unstructured run saves the weights as bitmask + non-zero values (``to_sparse_state_dict``) and prints
both file sizes; the structural run saves the pruned shapes beside the weights so the checkpoint reloads
into the smaller architecture with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning as L
import torch

from lightning_lowmem.callbacks.scheduled_pruning import ScheduledPruning
from lightning_lowmem.demo.digits import DigitsClassifier, DigitsDataModule
from lightning_lowmem.functional.pruning.unstructured import from_sparse_state_dict, sparsity, to_sparse_state_dict
from lightning_lowmem.functional.pruning.structural import pruned_shapes, restore_shapes_


def fit(model: L.LightningModule, epochs: int, callback: ScheduledPruning) -> float:
    data = DigitsDataModule(batch_size=64)
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        max_epochs=epochs,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, data)
    return float(trainer.test(model, data, verbose=False)[0]["test_acc"])


def unstructured(epochs: int, out: Path) -> None:
    steps = epochs * 20  # ~20 batches per epoch
    model = DigitsClassifier(arch="mlp", hidden=256)
    pruning = ScheduledPruning(
        "l1_unstructured",
        parameter_names=["weight"],
        schedule="cubic",
        target_sparsity=0.9,
        start_step=steps // 10,
        end_step=steps // 2,
        frequency=5,
    )
    accuracy = fit(model, epochs, pruning)
    dense_path, sparse_path = out / "dense.pt", out / "sparse.pt"
    torch.save(model.state_dict(), dense_path)
    torch.save(to_sparse_state_dict(model.state_dict()), sparse_path)
    restored = from_sparse_state_dict(torch.load(sparse_path, weights_only=True))
    assert all(torch.equal(restored[k], v) for k, v in model.state_dict().items())
    print(f"sparsity {sparsity(model):.1%}, test accuracy {accuracy:.2%}")
    print(
        f"checkpoint: dense {dense_path.stat().st_size / 1024:.0f} KiB, sparse {sparse_path.stat().st_size / 1024:.0f} KiB"
    )


def structural(epochs: int, out: Path) -> None:
    steps = epochs * 20
    model = DigitsClassifier(arch="cnn", hidden=32)
    before = sum(p.numel() for p in model.parameters())
    pruning = ScheduledPruning(
        "ln_structured",
        parameter_names=["weight"],
        use_global_unstructured=False,
        pruning_norm=2,
        schedule="linear",
        target_sparsity=0.5,
        start_step=steps // 5,
        end_step=steps // 2,
        structural=True,
    )
    accuracy = fit(model, epochs, pruning)
    path = out / "pruned_cnn.pt"
    torch.save({"state_dict": model.state_dict(), "shapes": pruned_shapes(model)}, path)
    saved = torch.load(path, weights_only=True)
    fresh = restore_shapes_(DigitsClassifier(arch="cnn", hidden=32), saved["shapes"])
    fresh.load_state_dict(saved["state_dict"])
    after = sum(p.numel() for p in fresh.parameters())
    print(
        f"parameters {before} -> {after} ({after / before:.0%}), test accuracy {accuracy:.2%}; reloaded from {path.name}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structural", action="store_true", help="remove conv channels instead of masking weights")
    parser.add_argument("--quick", action="store_true", help="a few epochs only")
    args = parser.parse_args()
    L.seed_everything(0)
    epochs = 3 if args.quick else 15
    with tempfile.TemporaryDirectory() as tmp:
        (structural if args.structural else unstructured)(epochs, Path(tmp))


if __name__ == "__main__":
    main()
